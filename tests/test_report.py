"""The report tables (kakeya_lab.bench.report) read run folders as the long runs write them:
partial runs and served arms are included and marked, failed turns are left out of p50s."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kakeya_lab.bench.report import long_run_latency_p50, read_index
from kakeya_lab.experiments.index import build_index
from kakeya_lab.experiments.run_record import RunRecord


def _run(
    root: Path, run_id: str, status: str, arms: dict[str, list[float]], error_turn=None
) -> None:
    folder = root / "long_run" / run_id
    record = RunRecord(folder, experiment="long_run", parameters={"turns": 4})
    record.start()
    rows = [
        {
            "arm": arm,
            "turn": turn,
            "append_latency_s": latency,
            "kv_live_bytes": 1000 * (turn + 1),
            "error": "UNAVAILABLE: server gone" if turn == error_turn else None,
        }
        for arm, latencies in arms.items()
        for turn, latency in enumerate(latencies)
    ]
    served = all(arm.startswith(("grpc_", "http_")) for arm in arms)
    pd.DataFrame(rows).to_csv(folder / ("served_turns.csv" if served else "turns.csv"), index=False)
    if status != "running":
        record.finish(status, error=None if status == "completed" else "stopped by SIGTERM")


def test_partial_and_served_runs_are_reported_and_marked(tmp_path: Path) -> None:
    _run(tmp_path, "done", "completed", {"sink_window": [0.1, 0.3, 0.5, 0.7]})
    _run(
        tmp_path,
        "cut",
        "partial",
        {"grpc_session": [0.2, 0.4, 9.0, 0.6]},
        error_turn=2,  # a failed turn: left out of the p50s
    )
    _run(tmp_path, "live", "running", {"sink_window": [1.0, 1.0, 1.0, 1.0]})
    build_index(tmp_path)
    table = long_run_latency_p50(read_index(tmp_path), tmp_path, buckets=2)

    assert set(table["run"]) == {"long_run/done", "long_run/cut"}  # a running run is not read
    done = table[table["run"] == "long_run/done"]
    assert done["append_p50_s"].tolist() == pytest.approx([0.2, 0.6])  # medians of 2-turn buckets
    assert not done["served"].any() and set(done["status"]) == {"completed"}
    assert done["label"].iloc[0] == "long_run/done sink_window"
    cut = table[table["run"] == "long_run/cut"]
    assert cut["served"].all() and set(cut["status"]) == {"partial"}
    assert cut["label"].iloc[0] == "long_run/cut (partial) served grpc_session"
    # turns 0, 1 | 3 (turn 2 failed): the bucket holding the failure has only turn 3
    assert cut["append_p50_s"].tolist() == pytest.approx([0.3, 0.6])


def test_an_empty_results_root_gives_an_empty_table(tmp_path: Path) -> None:
    table = long_run_latency_p50(read_index(tmp_path), tmp_path)
    assert table.empty and "label" in table.columns
