"""Named drafters: ``kakeya-lab align train NAME`` on the default real model makes one, and
``--proposer drafter:NAME`` (``make_proposer``, the CLI, the chat panel) loads it by name.

One real, small ``align train`` run (3 conversations, a few steps) is shared by the slow
tests; the fast ones need no drafter. ``KAKEYA_LAB_DRAFTERS`` points at a temporary folder
so the user's named drafters are never touched.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.cli import main
from kakeya_lab.data import domain_conversations
from kakeya_lab.proposers import make_proposer
from kakeya_lab.proposers.drafters.checkpoint import CheckpointError
from kakeya_lab.proposers.drafters.named import (
    DrafterNotFound,
    DrafterVerifierMismatch,
    check_name,
    drafter_names,
    list_drafters,
    load_named_drafter,
)

NAME = "t-feature"
TRAIN = [
    "align", "train", NAME, "--kind", "feature", "--steps", "8", "--conversations", "2",
    "--dev-conversations", "1", "--turns", "1", "--max-new-tokens", "24", "--window", "60",
    "--draft-vocab", "512", "--teacher-conversations", "2", "--teacher-turns", "3", "--quiet",
]  # fmt: skip


@pytest.fixture
def drafters_home(tmp_path):
    old = os.environ.get("KAKEYA_LAB_DRAFTERS")
    os.environ["KAKEYA_LAB_DRAFTERS"] = str(tmp_path / "drafters")
    yield tmp_path / "drafters"
    if old is None:
        del os.environ["KAKEYA_LAB_DRAFTERS"]
    else:
        os.environ["KAKEYA_LAB_DRAFTERS"] = old


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A named drafter made by the real CLI; the drafters folder and the CLI's output."""
    home = tmp_path_factory.mktemp("named") / "drafters"
    old = os.environ.get("KAKEYA_LAB_DRAFTERS")
    os.environ["KAKEYA_LAB_DRAFTERS"] = str(home)
    try:
        assert main(TRAIN) == 0
        yield home
    finally:
        if old is None:
            del os.environ["KAKEYA_LAB_DRAFTERS"]
        else:
            os.environ["KAKEYA_LAB_DRAFTERS"] = old


@pytest.fixture
def in_made(made):
    old = os.environ.get("KAKEYA_LAB_DRAFTERS")
    os.environ["KAKEYA_LAB_DRAFTERS"] = str(made)
    yield made
    if old is None:
        del os.environ["KAKEYA_LAB_DRAFTERS"]
    else:
        os.environ["KAKEYA_LAB_DRAFTERS"] = old


# ---------------------------------------------------------------- fast: no drafter needed


def test_drafter_names_are_checked():
    assert check_name("smollm2-feature.v1") == "smollm2-feature.v1"
    for bad in ("", ".hidden", "Upper", "a/b", "x" * 65, "a b"):
        with pytest.raises(ValueError, match="bad drafter name"):
            check_name(bad)


def test_unknown_name_on_an_empty_store_is_a_clear_error(drafters_home, default_model, capsys):
    assert list_drafters() == []
    with pytest.raises(DrafterNotFound, match="none yet.*align train"):
        load_named_drafter("nope", default_model.model, default_model.description.weight_sha256)
    assert main(["chat", "--proposer", "drafter:nope"]) == 2
    assert "no named drafter 'nope'" in capsys.readouterr().err
    out = drafters_home.parent / "long-run"
    long_run = ["long-run", str(out), "--arms", "sink_window,speculative", "--turns", "2"]
    assert main([*long_run, "--proposer", "drafter:nope"]) == 2
    assert "no named drafter 'nope'" in capsys.readouterr().err and not out.exists()
    assert main(["align", "train", "Bad/Name", "--steps", "1"]) == 2
    assert "bad drafter name" in capsys.readouterr().err
    assert not drafters_home.exists()  # nothing written by the refused commands


# ---------------------------------------------------------------- slow: one real align run


@pytest.mark.slow  # captures 3 real conversations and trains a drafter (about 40 s)
def test_align_train_makes_a_listed_named_drafter_with_its_record(in_made, default_model, capsys):
    rows = list_drafters()
    assert [r["name"] for r in rows] == [NAME]
    row = rows[0]
    assert row["kind"] == "feature" and row["verifier"] == default_model.description.name
    assert row["verifier_sha256"] == default_model.description.weight_sha256
    record = json.loads((in_made / NAME / "record.json").read_text())
    training = record["training"]
    assert training["steps"] == 8
    assert training["data"]["train"]["conversations"] == 2 + 2  # greedy + teacher-forced
    assert training["data"]["held_out"]["conversations"] == 1
    assert training["data"]["teacher_forced"] == {"conversations": 2, "turns": 3}
    stats = training["data"]["capture_stats"]
    assert sorted(stats) == ["chitchat-dev", "chitchat-train", "chitchat-train-teacher"]
    for folder in stats.values():
        assert folder["tokens"] > 0 and folder["bytes"] > 0 and folder["tokens_per_s"] > 0
    assert training["train_loss"] > 0 and training["held_out_loss"] > 0
    assert training["held_out_tau"] >= 1.0
    assert len(training["held_out_accept_by_position"]) == record["shape"]["block_size"]
    assert not any(p.name.startswith(".t-feature.") for p in in_made.iterdir())  # no temp left
    assert main(["align", "list", "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == [NAME]
    assert main([*TRAIN[:3], "--steps", "1"]) == 2  # the name exists: refused without work
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.slow  # captures 3 real conversations and trains a drafter (about 40 s)
def test_speculative_decoding_with_a_drafter_loaded_by_name_is_lossless(in_made, default_model):
    cache = SinkWindowConfig(sink=4, window=28)  # small: drafting crosses eviction

    def factory(kind):
        return lambda: make_proposer(
            f"{kind}:{NAME}",
            default_model.model,
            cache,
            default_model.tokenizer,
            verifier_sha256=default_model.description.weight_sha256,
        )

    run = run_speculative(
        default_model,
        {NAME: factory("drafter"), f"{NAME}-tree@6": factory("drafter-tree")},
        domain_conversations("chitchat", "dev", limit=1),
        SpeculativeSettings.for_cache(cache, draft_lengths=(3,), turns=2, max_new_tokens=16),
        progress=False,
    )
    assert greedy_streams_identical(run.turns)
    assert run.turns["history_len"].max() > 2 * 32
    for arm in (f"{NAME}@3", f"{NAME}-tree@6"):
        assert run.steps[run.steps["arm"] == arm]["proposed"].sum() > 0  # it did draft
    tree_steps = run.steps[(run.steps["arm"] == f"{NAME}-tree@6") & (run.steps["proposed"] > 0)]
    assert tree_steps["tree"].all()  # every step that drafted verified a tree


@pytest.mark.slow  # captures 3 real conversations and trains a drafter (about 40 s)
def test_a_drafter_for_other_verifier_weights_is_refused_naming_both(
    in_made, default_model, tiny_model, capsys
):
    sha = default_model.description.weight_sha256
    with pytest.raises(DrafterVerifierMismatch) as err:
        load_named_drafter(NAME, default_model.model, "f" * 64)
    message = str(err.value)
    assert sha[:12] in message and "f" * 12 in message
    assert default_model.description.name in message
    with pytest.raises(DrafterVerifierMismatch, match="unknown"):
        load_named_drafter(NAME, default_model.model, None)
    with pytest.raises(DrafterVerifierMismatch, match=sha[:12]):
        make_proposer(
            f"drafter:{NAME}",
            tiny_model.model,
            SinkWindowConfig(sink=4, window=28),
            verifier_sha256=tiny_model.description.weight_sha256,
        )


@pytest.mark.slow  # captures 3 real conversations and trains a drafter (about 40 s)
def test_half_written_or_damaged_drafters_are_not_listed_or_loaded(in_made, default_model):
    sha = default_model.description.weight_sha256
    src = in_made / NAME
    half = in_made / "half"  # the files without the manifest, as an interrupted copy would be
    shutil.copytree(src, half)
    (half / "manifest.json").unlink()
    temp = in_made / ".t2.abc123"  # a save under way (or killed) before its rename
    shutil.copytree(src, temp)
    short = in_made / "short"
    shutil.copytree(src, short)
    data = (short / "drafter.safetensors").read_bytes()
    (short / "drafter.safetensors").write_bytes(data[: len(data) // 2])
    flipped = in_made / "flipped"
    shutil.copytree(src, flipped)
    (flipped / "drafter.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    try:
        assert drafter_names() == ["flipped", NAME]  # same size: listed, caught on loading
        for name in ("half", "short", ".t2.abc123"):
            with pytest.raises(DrafterNotFound, match=f"{NAME}") as err:
                load_named_drafter(name, default_model.model, sha)
            assert "flipped" in str(err.value)
        with pytest.raises(CheckpointError, match="corrupted: drafter.safetensors"):
            load_named_drafter("flipped", default_model.model, sha)
    finally:
        for folder in (half, temp, short, flipped):
            shutil.rmtree(folder)


@pytest.mark.slow  # captures 3 real conversations and trains a drafter (about 40 s)
def test_the_chat_panel_offers_the_named_drafters_of_its_verifier(
    in_made, default_model, tiny_model
):
    from kakeya_lab.widgets import ChatPanel

    config = SinkWindowConfig(sink=4, window=28)
    panel = ChatPanel(default_model, config, max_new_tokens=4)
    assert f"drafter:{NAME}" in panel.proposer.options
    assert f"drafter-tree:{NAME}" in panel.proposer.options
    for spec in (f"drafter:{NAME}", f"drafter-tree:{NAME}"):
        panel.proposer.value = spec
        record = panel.send("Hi! How are you today?")
        panel.wait(120)
        assert record is not None and record.proposer == spec
        assert record.finished and record.token_ids and record.error is None
    other = ChatPanel(tiny_model, config, max_new_tokens=2)
    assert not any(o.startswith("drafter:") for o in other.proposer.options)


@pytest.mark.slow  # captures 3 real conversations and trains a drafter (about 40 s)
def test_a_second_run_reuses_the_capture_and_needs_no_training_checkpoint(in_made, default_model):
    work = in_made / ".work" / NAME
    assert not (work / "train").exists()  # removed once the drafter was saved
    manifests = [
        work / "rollouts" / f / "manifest.json"
        for f in ("chitchat-train", "chitchat-train-teacher")
    ]
    before = [m.read_text() for m in manifests]
    second = ["t-block" if a == NAME else a for a in TRAIN]
    second[second.index("feature")] = "block"
    second[second.index("--steps") + 1] = "3"  # other training settings: trains afresh
    try:
        assert main([*second, "--work-dir", str(work)]) == 0
        rows = {r["name"]: r for r in list_drafters()}
        assert sorted(rows) == ["t-block", NAME] and rows["t-block"]["kind"] == "block"
        assert rows["t-block"]["steps"] == 3
        for manifest, was in zip(manifests, before):  # both captures reused as they were
            assert json.loads(manifest.read_text())["shards"] == json.loads(was)["shards"]
        drafter = load_named_drafter(
            "t-block", default_model.model, default_model.description.weight_sha256
        )
        assert drafter.config.kind == "block"
        assert main(["chat", "--proposer", "drafter-tree:t-block"]) == 2  # before a model loads
        with pytest.raises(ValueError, match="feature drafter"):  # trees: one token per forward
            make_proposer(
                "drafter-tree:t-block",
                default_model.model,
                SinkWindowConfig(sink=4, window=28),
                verifier_sha256=default_model.description.weight_sha256,
            )
    finally:
        shutil.rmtree(in_made / "t-block", ignore_errors=True)


@pytest.mark.slow  # a real `align train` subprocess, interrupted, then run to the end (~60 s)
def test_an_interrupted_align_train_leaves_no_drafter_and_resumes(in_made, tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "KAKEYA_LAB_DRAFTERS": str(in_made),
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "kakeya_lab.cli", *TRAIN, "--steps", "40", "--work-dir", str(work)]
    cmd[cmd.index(NAME)] = "t-int"
    dev = work / "rollouts" / "chitchat-dev" / "manifest.json"
    # SIGINT as a terminal would deliver it, also when this suite runs as a background job
    # (which starts with SIGINT ignored, and a child would inherit that)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while not dev.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # the capture is done: training is under way
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-500:]
    assert "t-int" not in drafter_names() and not (in_made / "t-int").exists()
    assert not [p for p in in_made.iterdir() if p.name.startswith(".t-int.")]
    train_shards = json.loads((work / "rollouts" / "chitchat-train" / "manifest.json").read_text())
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr.decode()[-500:]
        assert "t-int" in drafter_names()
        again = json.loads((work / "rollouts" / "chitchat-train" / "manifest.json").read_text())
        assert again["shards"] == train_shards["shards"]  # the capture was resumed, not redone
    finally:
        shutil.rmtree(in_made / "t-int", ignore_errors=True)
