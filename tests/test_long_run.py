"""A short real long run (tiny window, so eviction starts in seconds), and resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from kakeya_lab.bench.long_run import (
    DegenerateRun,
    LongRunSettings,
    refuse_all_failed,
    refuse_degenerate,
    run_long,
)
from kakeya_lab.resume import ResumeMismatch
from kakeya_lab.settings import SettingsError

TURNS = 10
ARGS = dict(sink=4, window=40)


@pytest.fixture(scope="module")
def uninterrupted(aten_model):
    settings = LongRunSettings(
        arms=("sink_window", "full_cache"),
        **ARGS,
        turns=TURNS,
        max_new_tokens=6,
        probe_every=0,
        turns_per_bucket=3,
    )
    return run_long(aten_model, settings, progress=False)  # the standard turn script


@pytest.mark.slow  # the real default model over ten turns
def test_sink_window_is_bounded_and_full_cache_is_not(uninterrupted):
    s = uninterrupted.summary
    assert s["sink_window"]["kv_bounded"] is True, s["sink_window"]["kv_bounded_by_turns"]
    assert s["full_cache"]["kv_bounded"] is False
    sw = uninterrupted.turns[uninterrupted.turns["arm"] == "sink_window"]
    fc = uninterrupted.turns[uninterrupted.turns["arm"] == "full_cache"]
    assert sw["cache_len"].iloc[-1] == ARGS["sink"] + ARGS["window"] < sw["history_len"].iloc[-1]
    assert (
        fc["kv_live_bytes"].is_monotonic_increasing
        and fc["kv_live_bytes"].iloc[-1] > sw["kv_live_bytes"].iloc[-1]
    )
    assert (sw["kv_live_bytes"] > 0).all()
    # both arms saw the same user turns; the histories differ only by the replies
    assert list(sw["user_tokens"]) == list(fc["user_tokens"])


def test_degenerate_runs_are_refused():
    with pytest.raises(DegenerateRun):
        refuse_degenerate([{"arm": "sink_window", "turn": 0, "kv_live_bytes": 0}])
    failed = [
        {"arm": "sink_window", "turn": 0, "error": "turn 0: SessionError: boom"},
        {"arm": "full_cache", "turn": 0, "error": "turn 0: SessionError: boom"},
    ]
    with pytest.raises(DegenerateRun, match="every turn failed"):
        refuse_all_failed(failed)
    refuse_all_failed(
        failed + [{"arm": "full_cache", "turn": 1, "error": None}]
    )  # one success: a result


def _tiny(turns: int, **changes) -> LongRunSettings:
    """Settings of a short run on the tiny model: one sink-window arm, no probe."""
    base = dict(arms=("sink_window",), sink=4, window=16, turns=turns, probe_every=0)
    return LongRunSettings(**{**base, **changes})


def test_resume_refuses_other_settings_and_force_new_starts_over(tmp_path, tiny_model):
    turns = ["Hello there.", "How are you?", "Tell me more.", "And then?"]
    out = tmp_path / "run"
    settings = _tiny(2, max_new_tokens=3)
    first = run_long(tiny_model, settings, turns[:2], out_dir=out, progress=False)
    saved = (out / "checkpoint.json").read_text()
    cases = [
        (settings.replace(max_new_tokens=4), turns[:2], "max_new_tokens"),
        (settings.replace(window=20), turns[:2], "window"),
        (settings.replace(positions="rolling"), turns[:2], "positions"),
        (settings.replace(arms=("sink_window", "full_cache")), turns[:2], "full_cache"),
        (settings, turns[1:3], "turns.sha256"),
        (settings.replace(turns=3), turns[:3], "turns.count"),
    ]
    for changed, script, named in cases:
        with pytest.raises(ResumeMismatch, match=named):
            run_long(tiny_model, changed, script, out_dir=out, progress=False)
        assert (out / "checkpoint.json").read_text() == saved  # refused before anything changed
    again = run_long(tiny_model, settings, turns[:2], out_dir=out, progress=False)
    pd.testing.assert_frame_equal(
        again.turns, first.turns
    )  # same settings: resumes (nothing left to run)
    fresh = run_long(
        tiny_model,
        settings.replace(turns=3, max_new_tokens=4),
        turns[:3],
        out_dir=out,
        progress=False,
        force_new=True,
    )
    assert sorted(fresh.turns["turn"]) == [0, 1, 2] and (fresh.turns["generated_tokens"] <= 4).all()


def test_settings_are_validated_once_on_construction_and_round_trip():
    with pytest.raises(SettingsError, match="turns must be >= 1"):
        LongRunSettings(turns=0)
    with pytest.raises(SettingsError, match="no arms given"):
        LongRunSettings(arms=())
    with pytest.raises(SettingsError, match="positions"):
        LongRunSettings(positions="diagonal")
    with pytest.raises(SettingsError, match="unknown to LongRunSettings"):
        LongRunSettings.from_dict({"turnz": 3})
    settings = _tiny(4, turn_spacing_s=0.5)
    doc = json.loads(json.dumps(settings.to_dict()))  # as run.json / metrics.json keep it
    assert LongRunSettings.from_dict(doc) == settings and doc["arms"] == ["sink_window"]
    assert settings.replace(window=20).differences(settings) == ["window: was 16, now 20"]
    # control: a script of another length than the settings say is refused before running
    with pytest.raises(ValueError, match="give as many"):
        run_long(None, settings, ["one turn"], progress=False)


def _cli(out_dir):
    return [
        sys.executable,
        "-m",
        "kakeya_lab.cli",
        "long-run",
        str(out_dir),
        "--turns",
        str(TURNS),
        "--arms",
        "sink_window,full_cache",
        "--sink",
        str(ARGS["sink"]),
        "--window",
        str(ARGS["window"]),
        "--max-new-tokens",
        "6",
        "--checkpoint-every",
        "2",
        "--probe-every",
        "0",
        "--turns-per-bucket",
        "3",
        "--quiet",
    ]


@pytest.mark.slow  # the real default model over ten turns
def test_resume_after_kill_loses_no_completed_turn(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _cli(out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    checkpoint = out / "checkpoint.json"
    deadline = time.monotonic() + 300
    saved = None
    while time.monotonic() < deadline:
        if checkpoint.exists():
            saved = json.loads(checkpoint.read_text())
            if 4 <= saved["next_turn"] < TURNS:
                break
        if proc.poll() is not None:
            pytest.fail(
                f"the run ended before it could be interrupted: {proc.stderr.read().decode()[-2000:]}"
            )
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = json.loads(checkpoint.read_text())  # the last checkpoint written before the kill
    done_before = pd.DataFrame(saved["rows"])
    assert 4 <= saved["next_turn"] < TURNS and len(done_before) == 2 * saved["next_turn"]

    changed = subprocess.run(
        _cli(out) + ["--window", str(ARGS["window"] + 1)], capture_output=True, text=True
    )
    assert changed.returncode == 2, changed.stderr
    assert (
        "window: was 40, now 41" in changed.stderr and len(changed.stderr.strip().splitlines()) == 1
    )
    assert json.loads(checkpoint.read_text()) == saved

    subprocess.run(_cli(out), check=True, capture_output=True)
    final = pd.read_csv(out / "turns.csv")
    assert sorted(final.groupby("arm")["turn"].apply(list).to_dict().items()) == [
        ("full_cache", list(range(TURNS))),
        ("sink_window", list(range(TURNS))),
    ]
    # completed turns are kept as they were
    kept = final.merge(done_before, on=["arm", "turn"], suffixes=("", "_before"))
    assert len(kept) == len(done_before)
    assert (kept["reply"].fillna("") == kept["reply_before"].fillna("")).all()
    assert (kept["history_len"] == kept["history_len_before"]).all()
    # and the resumed turns continue exactly where the uninterrupted run went (greedy)
    ref = uninterrupted.turns.set_index(["arm", "turn"])
    for row in final.itertuples():
        assert row.history_len == ref.loc[(row.arm, row.turn), "history_len"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["metrics"]["arms"]["sink_window"]["kv_bounded"] is True
    assert metrics["schema_version"] == 1 and metrics["model"]["name"] == "smollm2-135m-instruct"
