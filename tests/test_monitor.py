"""The live monitors without a browser: a real long run (tiny random model, paced turns)
written into a folder while a RunMonitor follows it; the server monitor against a real
server's /metrics. Mechanics only: no figure here is a quality number."""

from __future__ import annotations

import base64
import json
import threading
import time
import traceback

import numpy as np
import pytest

from kakeya_lab.bench.long_run import LongRunSettings, run_long, save_long_run
from kakeya_lab.widgets.monitor import RunMonitor, read_run_folder, server_samples

SETTINGS = dict(arms=("sink_window", "full_cache"), sink=4, window=12, turns=8, max_new_tokens=3)
SETTINGS |= dict(probe_every=0, turns_per_bucket=2, checkpoint_every=1, turn_spacing_s=0.25)


def _kv_points(monitor: RunMonitor) -> int:
    """How many turns the KV panel's first line shows (plotly sends numpy arrays as
    base64 ``bdata``)."""
    if not monitor.figure.outputs:
        return 0
    fig = monitor.figure.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    x = fig["data"][0]["x"]
    if isinstance(x, dict):
        return len(np.frombuffer(base64.b64decode(x["bdata"]), dtype=x["dtype"]))
    return len(x)


@pytest.mark.slow
def test_the_run_monitor_follows_a_running_long_run_to_its_end(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    settings = LongRunSettings(**SETTINGS)
    monitor = RunMonitor(run_dir, every_s=0.05, bucket_turns=2)
    monitor.refresh()
    assert read_run_folder(run_dir).status == "waiting" and _kv_points(monitor) == 0

    def report(run) -> None:
        save_long_run(run_dir, settings, tiny_model.description, run=run)

    errors: list[BaseException] = []

    def drive() -> None:
        try:
            run = run_long(
                tiny_model,
                settings,
                out_dir=run_dir,
                on_report=report,
                catch_signals=False,
                progress=False,
            )
            report(run)
        except BaseException as exc:  # shown by the assertion below
            errors.append(exc)

    runner = threading.Thread(target=drive)
    runner.start()
    seen = []
    monitor.start()
    deadline = time.monotonic() + 300
    while runner.is_alive() and time.monotonic() < deadline:
        seen.append(_kv_points(monitor))
        time.sleep(0.05)
    runner.join(60)
    assert not errors, "".join(traceback.format_exception(errors[0]))
    end = time.monotonic() + 60
    while monitor.running and time.monotonic() < end:  # it stops by itself at the end
        time.sleep(0.05)
    assert not monitor.running
    state = read_run_folder(run_dir)
    assert state.status == "ended" and state.turns_done == 8 and state.failed_turns == 0
    assert state.budget_bytes and state.budget_bytes > 0
    # the figure grew while the run wrote turns: several sizes seen on the way to the end
    grown = sorted(set(seen) - {0})
    assert len(grown) >= 3 and _kv_points(monitor) == 8 > grown[0]
    assert 'data-state="ended"' in monitor.status.value and "turn 8 of 8" in monitor.status.value
    fig = monitor.figure.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    names = {t.get("name") for t in fig["data"]}
    assert {"sink_window", "full_cache"} <= names
    json.dumps(monitor.figure.outputs[0])  # what the widget sends the page is plain JSON


def test_a_damaged_or_missing_folder_is_said_not_raised(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run folder"):
        read_run_folder(tmp_path / "nowhere")
    (tmp_path / "metrics.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        read_run_folder(tmp_path)
    monitor = RunMonitor(tmp_path, every_s=0.05)
    assert monitor.refresh() is False  # the monitor keeps watching
    assert (
        'data-state="error"' in monitor.status.value and "not readable JSON" in monitor.status.value
    )
    with pytest.raises(ValueError, match="every_s"):
        RunMonitor(tmp_path, every_s=0)
    with pytest.raises(ValueError, match="bucket_turns"):
        RunMonitor(tmp_path, bucket_turns=0)


def test_server_samples_read_the_servers_metrics():
    text = "\n".join(
        [
            "# TYPE kakeya_sessions_open gauge",
            "kakeya_sessions_open 3.0",
            "# TYPE kakeya_kv_live_bytes gauge",
            "kakeya_kv_live_bytes 1048576.0",
            "# TYPE kakeya_generated_tokens_total counter",
            "kakeya_generated_tokens_total 120.0",
            "# TYPE kakeya_request_errors_total counter",
            'kakeya_request_errors_total{status="400"} 2.0',
            'kakeya_request_errors_total{status="429"} 1.0',
        ]
    )
    first = server_samples(text, None, 1.0)
    assert first["sessions_open"] == 3 and first["errors_total"] == 3 and first["tokens_per_s"] == 0
    later = server_samples(text.replace("120.0", "180.0"), first, 3.0)
    assert later["tokens_per_s"] == pytest.approx(30.0)
    with pytest.raises(ValueError, match="not a kakeya-lab server"):
        server_samples("# TYPE other gauge\nother 1.0\n", None, 0.0)
