"""A long run's identity and its edges: the linear kernel, the speculative arm's proposer and
draft length are part of what a strict resume compares and what ``metrics.json`` records; a
damaged checkpoint is a clear error that changes nothing; a signal while a resume is being
set up leaves the run folder as it was.

Mechanics on the tiny random model through the in-process API (the command line's own
checks before the model loads: tests/test_long_run_cli_checks.py).
"""

from __future__ import annotations

import json
import signal

import pytest

from kakeya_lab.bench.long_run import LongRunSettings, StoppedBeforeStart, run_long
from kakeya_lab.bench.long_run.identity import read_checkpoint
from kakeya_lab.experiments.long_run import Invocation, record_long_run
from kakeya_lab.linear import set_linear_kernel
from kakeya_lab.models import tiny_random_model
from kakeya_lab.proposers import ProposerKind, proposer_kind, register_proposer
from kakeya_lab.proposers.registry import unregister_proposer
from kakeya_lab.resume import DamagedCheckpoint, ResumeError, ResumeMismatch

TURNS = ["Hello there.", "How are you?"]
BASE = dict(sink=4, window=16, turns=2, max_new_tokens=3, probe_every=0, checkpoint_every=1)


def _settings(**changes) -> LongRunSettings:
    return LongRunSettings(**{**BASE, "arms": ("sink_window",), **changes})


def _record(loaded, settings, out):
    return record_long_run(
        loaded, settings, out, Invocation(["kakeya-lab", "long-run"], {}), progress=False
    )


def _files(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture
def onednn_model():
    """Its own tiny model (the same weights as ``tiny_model``) on oneDNN's kernel, so the
    shared one keeps ``aten``."""
    loaded = tiny_random_model("qwen3", seed=0)
    set_linear_kernel(loaded.model, "onednn")
    return loaded


def test_the_linear_kernel_is_part_of_the_identity(tiny_model, onednn_model, tmp_path):
    out = tmp_path / "run"
    _record(tiny_model, _settings(), out)
    saved = json.loads((out / "checkpoint.json").read_text())
    assert saved["settings"]["model"]["linear"] == "aten"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["linear"] == "aten" and metrics["proposer"] is None
    before = _files(out)
    # same weights, another kernel: refused, naming it, nothing changed
    with pytest.raises(ResumeMismatch, match="model.linear: was 'aten', now 'onednn'"):
        _record(onednn_model, _settings(linear="onednn"), out)
    assert _files(out) == before
    # settings that say another kernel than the model runs are refused before anything
    with pytest.raises(ValueError, match="run 'onednn' but settings.linear is 'aten'"):
        run_long(onednn_model, _settings(), TURNS, out_dir=tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="settings.linear"):  # and the folder's record stays
        _record(onednn_model, _settings(), out)
    assert _files(out) == before


def test_a_checkpoint_from_before_the_kernel_was_recorded_is_taken_as_aten(
    tiny_model, onednn_model, tmp_path
):
    out = tmp_path / "run"
    run_long(tiny_model, _settings(), TURNS, out_dir=out, progress=False)
    path = out / "checkpoint.json"
    doc = json.loads(path.read_text())
    del doc["settings"]["model"]["linear"]  # as such a checkpoint was written
    path.write_text(json.dumps(doc))
    with pytest.raises(ResumeMismatch, match="model.linear: was 'aten', now 'onednn'"):
        run_long(onednn_model, _settings(linear="onednn"), TURNS, out_dir=out, progress=False)
    again = run_long(tiny_model, _settings(), TURNS, out_dir=out, progress=False)
    assert sorted(again.turns["turn"]) == [0, 1]  # resumed: nothing left to run


def test_the_speculative_arms_proposer_and_draft_length_are_recorded_and_compared(
    tiny_model, tmp_path
):
    out = tmp_path / "run"
    settings = _settings(arms=("sink_window", "speculative"), proposer="ngram", draft_length=3)
    _record(tiny_model, settings, out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["proposer"] == {"spec": "ngram", "draft_length": 3}
    assert metrics["linear"] == "aten"
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "completed"
    before = _files(out)
    cases = [
        (settings.replace(draft_length=2), "arms.speculative.draft_length: was 3, now 2"),
        (
            settings.replace(proposer="suffix"),
            "arms.speculative.proposer: was 'ngram', now 'suffix'",
        ),
    ]
    for changed, named in cases:
        with pytest.raises(ResumeMismatch, match=named):
            _record(tiny_model, changed, out)
        assert _files(out) == before  # run.json still says completed


def _damage(doc: dict, how: str) -> str:
    if how == "truncated":
        return json.dumps(doc)[:100]
    if how == "next_turn a string":
        doc["next_turn"] = "2"
    elif how == "rows missing":
        del doc["rows"]
    elif how == "history not ids":
        doc["arms"]["sink_window"]["history_ids"] = ["a", "b"]
    elif how == "chat state missing":
        del doc["arms"]["sink_window"]["chat"]
    elif how == "an arm missing":
        del doc["arms"]["sink_window"]
    elif how == "plant_len not counts":
        doc["plant_len"] = {"sink_window": "x"}
    elif how == "a list":
        return "[]"
    return json.dumps(doc)


DAMAGES = [
    "truncated",
    "next_turn a string",
    "rows missing",
    "history not ids",
    "chat state missing",
    "an arm missing",
    "plant_len not counts",
    "a list",
]


def test_a_damaged_checkpoint_is_a_clear_error_that_changes_nothing(tiny_model, tmp_path):
    out = tmp_path / "run"
    _record(tiny_model, _settings(), out)
    good = (out / "checkpoint.json").read_text()
    for how in DAMAGES:
        (out / "checkpoint.json").write_text(_damage(json.loads(good), how))
        before = _files(out)
        with pytest.raises(DamagedCheckpoint, match="checkpoint.json") as info:
            _record(tiny_model, _settings(), out)
        assert isinstance(info.value, ResumeError), how
        assert "--force-new" in str(info.value) and "\n" not in str(info.value), how
        assert _files(out) == before, how  # run.json still says completed
        assert json.loads(before["run.json"])["status"] == "completed"
    (out / "checkpoint.json").write_text(good)
    assert read_checkpoint(out / "checkpoint.json")["next_turn"] == 2  # control: the good one reads


@pytest.fixture
def signal_on_build():
    """A proposer kind ``ngram-signal`` (an n-gram proposer) that, once ``armed`` holds a
    signal, raises it at this process while it is being built — as a signal arriving while
    a resume rebuilds its arms."""
    armed: list[int] = []
    ngram = proposer_kind("ngram")

    def build(argument, request):
        if armed:
            signal.raise_signal(armed[0])
        return ngram.builder()(argument, request)

    register_proposer(
        ProposerKind(
            name="ngram-signal",
            usage="ngram-signal",
            summary="an n-gram proposer that raises a signal when built (tests)",
            build=build,
        )
    )
    try:
        yield armed
    finally:
        unregister_proposer("ngram-signal")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_a_resume_is_set_up_leaves_the_folder_as_it_was(
    tiny_model, tmp_path, signal_on_build, sig
):
    out = tmp_path / "run"
    settings = _settings(arms=("sink_window", "speculative"), proposer="ngram-signal")
    _record(tiny_model, settings, out)
    before = _files(out)
    assert json.loads(before["run.json"])["status"] == "completed"
    signal_on_build.append(sig)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StoppedBeforeStart) as info:
        _record(tiny_model, settings, out)
    assert info.value.signal == signal.Signals(sig).name
    assert _files(out) == before  # not "running": the record, checkpoint and report as they were
    assert signal.getsignal(signal.SIGTERM) == handler  # the handlers were put back


@pytest.mark.slow  # the default model through the command, twice
def test_the_command_stopped_while_resuming_exits_with_the_signal_and_changes_nothing(
    tmp_path, signal_on_build, capsys
):
    from kakeya_lab.cli import main

    out = tmp_path / "run"
    argv = ["long-run", str(out), "--arms", "sink_window,speculative", "--proposer"]
    argv += ["ngram-signal", "--sink", "4", "--window", "12", "--turns", "2"]
    argv += ["--max-new-tokens", "2", "--probe-every", "0", "--quiet"]
    assert main(argv) == 0
    before = _files(out)
    signal_on_build.append(signal.SIGTERM)
    assert main(argv) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "kakeya-lab: stopped by SIGTERM before the first turn; nothing was written; "
        "run again to resume"
    )
    assert _files(out) == before  # run.json still says completed
