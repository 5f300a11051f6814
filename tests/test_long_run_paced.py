"""Paced and durable long runs: turns spaced in wall-clock time, reports every N seconds,
a final partial report on SIGTERM, and resume after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from kakeya_lab.bench.long_run import LongRunSettings, run_long
from kakeya_lab.settings import SettingsError

TURNS = ["Hello there.", "How are you?", "Tell me more.", "And then?", "Why so?", "Go on."]


def _tiny(turns: int, **changes) -> LongRunSettings:
    """A short run on the tiny model: one sink-window arm, two new tokens a turn, no probe."""
    base = dict(
        arms=("sink_window",), sink=4, window=16, turns=turns, max_new_tokens=2, probe_every=0
    )
    return LongRunSettings(**{**base, **changes})


def test_paced_turns_start_spacing_apart_and_time_reports_are_partial(tmp_path, tiny_model):
    reports = []
    run = run_long(
        tiny_model,
        _tiny(
            4, checkpoint_every=100, turn_spacing_s=0.3, report_every_s=0.25, seconds_per_bucket=0.6
        ),
        TURNS[:4],
        out_dir=tmp_path / "run",
        on_report=reports.append,
        progress=False,
    )
    starts = run.turns["wall_s"] - run.turns["append_latency_s"] - run.turns["generate_s"]
    for i, start in enumerate(starts):
        assert start >= 0.3 * i - 0.02, (i, start)  # never early (measured after the turn)
    assert run.duration_s >= 0.9 and not run.partial and run.abort_reason is None
    # every report but the last is partial; reports came by time (checkpoint_every is 100),
    # checked after each round, each at least report_every_s after the one before. How many
    # depends on how long rounds take on a busy machine (a slow first round can leave one),
    # but there is at least one: the check after the last round, 0.9 s in, finds 0.25 s
    # passed since the start unless a report came since
    assert [r.partial for r in reports] == [True] * (len(reports) - 1) + [False]
    times = [0.0] + [r.duration_s for r in reports[:-1]]
    assert len(times) >= 2 and all(b - a >= 0.25 for a, b in zip(times, times[1:])), times
    assert run.summary["sink_window"]["buckets_by_time"][0]["index"] == 0
    assert len(run.summary["sink_window"]["buckets_by_time"]) >= 2  # 0.9 s over 0.6 s buckets
    # control: without pacing the same run is done well before 0.9 s of spacing
    fast = run_long(tiny_model, _tiny(4), TURNS[:4], progress=False)
    assert fast.duration_s < 0.9


def test_sigint_in_process_ends_the_run_with_a_partial_report(tmp_path, tiny_model):
    reports = []
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job

    def on_report(run) -> None:  # a real SIGINT, sent once the first checkpoint is written
        reports.append(run)
        if len(reports) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    settings = _tiny(len(TURNS), checkpoint_every=1, turn_spacing_s=0.3)
    run = run_long(
        tiny_model, settings, TURNS, out_dir=tmp_path / "run", on_report=on_report, progress=False
    )
    assert run.partial and run.abort_reason == "SIGINT" and reports[-1].abort_reason == "SIGINT"
    done = json.loads((tmp_path / "run" / "checkpoint.json").read_text())["next_turn"]
    assert 1 <= done < len(TURNS) and list(run.turns["turn"]) == list(range(done))
    assert signal.getsignal(signal.SIGINT) == before  # the handler is given back
    # control: resumed without a signal, the run completes (pacing is part of the strict settings)
    again = run_long(tiny_model, settings, TURNS, out_dir=tmp_path / "run", progress=False)
    assert (
        not again.partial
        and again.abort_reason is None
        and list(again.turns["turn"]) == list(range(len(TURNS)))
    )


def test_duration_limit_stops_starting_rounds(tiny_model):
    run = run_long(
        tiny_model, _tiny(len(TURNS), duration_s=1.0, turn_spacing_s=0.4), TURNS, progress=False
    )
    assert list(run.turns["turn"]) == [0, 1, 2]  # rounds at 0, 0.4, 0.8 s; none at 1.2 s


def test_bad_pacing_settings_are_refused_before_running():
    for kwargs, named in (
        ({"turn_spacing_s": 0}, "turn_spacing_s"),
        ({"report_every_s": -1}, "report_every_s"),
        ({"seconds_per_bucket": float("inf")}, "seconds_per_bucket"),
    ):
        with pytest.raises(SettingsError, match=named):
            _tiny(len(TURNS), **kwargs)


def _cli(out_dir, turns):
    return [
        sys.executable,
        "-m",
        "kakeya_lab.cli",
        "long-run",
        str(out_dir),
        "--turns",
        str(turns),
        "--arms",
        "sink_window",
        "--sink",
        "4",
        "--window",
        "40",
        "--max-new-tokens",
        "4",
        "--checkpoint-every",
        "1",
        "--probe-every",
        "0",
        "--turns-per-bucket",
        "2",
        "--turn-spacing-s",
        "0.5",
        "--seconds-per-bucket",
        "1",
        "--quiet",
    ]


@pytest.mark.slow  # the real default model in a subprocess
def test_sigterm_writes_a_partial_report_and_resume_completes(tmp_path):
    out, turns = tmp_path / "run", 8
    proc = subprocess.Popen(
        _cli(out, turns),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    checkpoint = out / "checkpoint.json"
    record = out / "run.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if checkpoint.exists() and json.loads(checkpoint.read_text())["next_turn"] >= 2:
            running = json.loads(record.read_text())  # kept current by the partial reports
            assert running["status"] == "running" and running["progress"]["turns"] >= 1
            break
        if proc.poll() is not None:
            pytest.fail(f"the run ended before the signal: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)  # a bound: the turn under way finishes first
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert "stopped by SIGTERM" in err.decode()
    metrics = json.loads((out / "metrics.json").read_text())
    done = json.loads(checkpoint.read_text())["next_turn"]
    assert metrics["metrics"]["partial"] is True and metrics["metrics"]["abort_reason"] == "SIGTERM"
    assert metrics["headline"]["abort_reason"] == "SIGTERM"
    assert 2 <= done < turns and metrics["metrics"]["arms"]["sink_window"]["turns"] == done
    assert list(pd.read_csv(out / "turns.csv")["turn"]) == list(range(done))
    stopped = json.loads(record.read_text())
    assert stopped["status"] == "partial" and "SIGTERM" in stopped["error"]["message"]
    assert stopped["experiment"] == "long_run" and stopped["run_id"] == "run"

    resumed = subprocess.run(_cli(out, turns), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["metrics"]["partial"] is False and metrics["metrics"]["abort_reason"] is None
    assert metrics["metrics"]["arms"]["sink_window"]["turns"] == turns
    assert metrics["metrics"]["duration_s"] >= 0.5 * (turns - 1)  # paced across the interruption
    assert list(pd.read_csv(out / "turns.csv")["turn"]) == list(range(turns))
    ended = json.loads(record.read_text())
    assert ended["status"] == "completed" and ended["error"] is None
    assert ended["started"] == stopped["started"] and len(ended["resumed"]) == 1
