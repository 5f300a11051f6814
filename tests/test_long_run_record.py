"""Every CLI long run is a run folder the index lists: ``run.json`` with the command,
its options and a status kept current (running, partial, completed, failed)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kakeya_lab.cli import main
from kakeya_lab.experiments import build_index
from kakeya_lab.experiments.run_record import RunRecord
from kakeya_lab.results import mark_results_root

ARGS = ["--arms", "sink_window", "--sink", "4", "--window", "12", "--max-new-tokens", "2"]
ARGS += ["--probe-every", "0", "--turns-per-bucket", "1", "--checkpoint-every", "1", "--quiet"]


@pytest.mark.slow  # the real default model through the CLI, twice
def test_long_run_cli_writes_run_json_and_lands_in_the_index(tmp_path, capsys):
    results = mark_results_root(tmp_path / "results")
    out = results / "lr_small"
    assert main(["long-run", str(out), "--turns", "3", *ARGS]) == 0
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "completed" and record["error"] is None
    assert record["experiment"] == "long_run" and record["run_id"] == "lr_small"
    assert record["command"][:3] == ["kakeya-lab", *record["command"][1:3]]
    assert record["parameters"]["turns"] == 3 and record["parameters"]["window"] == 12
    assert record["progress"]["turns"] >= 1 and record["started"] <= record["ended"]
    # the CLI refreshed the index of the results tree holding the run
    index = pd.read_parquet(results / "index.parquet")
    row = index[index["run_id"] == "lr_small"].iloc[0]
    assert row["experiment"] == "long_run" and row["status"] == "completed"
    assert row["param.turns"] == 3 and "long-run" in row["command"]
    assert row["metric.sink_window.kv_bounded"] in (True, False)  # headline metrics indexed
    assert row["model"] == json.loads((out / "metrics.json").read_text())["model"]["name"]

    # a resume with other settings is refused and leaves the record as it was
    before = (out / "run.json").read_bytes()
    assert main(["long-run", str(out), "--turns", "3", *ARGS, "--max-new-tokens", "3"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
    assert (out / "run.json").read_bytes() == before


def test_index_lists_notebook_depth_and_cli_depth_run_folders(tmp_path):
    results = tmp_path / "results"
    deep = RunRecord(results / "exp" / "r0", experiment="exp", command=["x"], parameters={})
    deep.start()
    shallow = RunRecord(results / "lr", experiment="long_run", command=["y"], parameters={})
    shallow.start()
    shallow.progress(turns=5)
    (results / "not_a_run").mkdir()
    index = build_index(results)
    assert sorted(index["run_id"]) == ["lr", "r0"]
    assert set(index["status"]) == {"running"}
    shallow.finish("failed", "boom")
    index = build_index(results)
    assert index.set_index("run_id").loc["lr", "status"] == "failed"
    assert index.set_index("run_id").loc["lr", "error"] == "boom"
