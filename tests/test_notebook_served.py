"""Notebook 20 driving a real server: ``kakeya-lab serve`` started by the test on free
loopback ports, the notebook executed through papermill (:func:`run_notebook`) with its
``endpoint`` parameter naming the server's two addresses and one in-process arm beside
them, the server stopped at the end. The served arms' token accounting is checked, not
their timings (a test must not time), and the run folder as ``test_run_folders`` checks
every other notebook's."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from test_run_folders import check_figures

from kakeya_lab.experiments import run_notebook
from kakeya_lab.results import validate_metrics

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

pytest.importorskip("papermill")


@pytest.mark.slow  # a server, a papermill kernel and three served arms: about a minute
def test_notebook_20_drives_a_running_server_through_both_clients(serve, tmp_path):
    server = serve("--sink", "4", "--window", "40")
    params = {
        "arms": ["sink_window"],
        "window": 40,
        "endpoint": f"grpc://{server.grpc_target} {server.http_base}",
        "turns": 5,
        "max_new_tokens": 6,
        "probe_every": 0,
        "turns_per_bucket": 2,
    }
    open_before = server.metrics()["kakeya_sessions_open"]
    run_dir = run_notebook(
        NOTEBOOKS / "20_long_run.ipynb", params, results_root=tmp_path, progress=False
    )
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["parameters"] == params
    doc = json.loads((run_dir / "metrics.json").read_text())
    validate_metrics(doc)
    assert doc["experiment"] == record["experiment"] and doc["run_id"] == record["run_id"]
    assert doc["model"]["name"] == "smollm2-135m-instruct" and doc["model"]["random"] is False
    check_figures(run_dir, tmp_path)
    assert doc["server_cache"] == {
        "sink": 4,
        "budget_tokens": 44,
        "kv_budget_bytes": 44 * 30 * 2 * 3 * 64 * 4,
    }
    summary = doc["metrics"]["arms"]
    assert list(summary) == ["sink_window", "grpc_session", "http_reuse", "http_stateless"]
    turns = pd.read_csv(run_dir / "served_turns.csv")
    assert len(turns) == 15 and turns["error"].isna().all()
    by_arm = {arm: df.set_index("turn") for arm, df in turns.groupby("arm")}
    # session-bound arms prefill only the new message; the stateless one everything again
    for arm in ("grpc_session", "http_reuse"):
        assert (by_arm[arm]["cached_tokens"].iloc[1:] > 0).all(), arm
    stateless = by_arm["http_stateless"]
    assert (stateless["cached_tokens"] == 0).all()
    assert stateless["appended_tokens"].is_monotonic_increasing
    assert (
        stateless["appended_tokens"].iloc[1:] > by_arm["http_reuse"]["appended_tokens"].iloc[1:]
    ).all()
    # every session the notebook's clients opened is closed again
    assert server.metrics()["kakeya_sessions_open"] == open_before
    assert (turns["cache_len"] <= 44).all()
    # past eviction, so the budget lines the notebook prints below are not true by default
    grpc = by_arm["grpc_session"]
    assert grpc["history_len"].iloc[-1] > 44 and grpc["cache_len"].iloc[-1] == 44
    own = pd.read_csv(run_dir / "turns.csv")
    assert own["history_len"].max() > 44 and own["cache_len"].max() == 44
    notebook = (run_dir / "notebook.ipynb").read_text()
    assert "the server's sessions never hold more than its budget of 44 entries: True" in notebook
    assert "sink_window never holds more than sink + window = 44 entries: True" in notebook
