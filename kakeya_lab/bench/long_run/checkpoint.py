"""Checkpoint and strict resume of a long run.

``checkpoint.json`` holds the run's settings (:func:`run_settings`: model identity with
the linear kernel, arms and their caches and proposers, generation settings, the turn
script), the per-turn rows so far, and each arm's committed history and chat state.
Resuming replays each arm's history into a fresh session (which gives the same cache) —
and only if the settings asked for now are the saved ones and the file reads back whole
(:func:`~kakeya_lab.bench.long_run.identity.check_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kakeya_lab.bench.long_run.arms import Arm
from kakeya_lab.bench.long_run.identity import check_checkpoint, model_identity, saved_settings
from kakeya_lab.bench.long_run.settings import OUTPUTS, LongRunSettings
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.durable import write_json_atomic
from kakeya_lab.session import SessionStore


def loaded_kernel(loaded) -> str:
    """The kernel a loaded torch model's linear layers run ("" for another backend)."""
    if getattr(loaded.description, "backend", "torch") != "torch":
        return ""
    from kakeya_lab.linear import linear_kernel_of

    return linear_kernel_of(loaded.model)


def run_settings(
    loaded, arms: Mapping[str, Arm], user_turns: Sequence[str], settings: LongRunSettings
) -> dict:
    """Everything that shapes a long run's numbers, as the checkpoint saves it
    (:func:`~kakeya_lab.bench.long_run.identity.saved_settings` with the loaded model's
    identity and the kernel it runs)."""
    d = loaded.description
    model = model_identity(
        d.name, d.weight_sha256, getattr(d, "backend", "torch"), loaded_kernel(loaded)
    )
    return saved_settings(model, arms, user_turns, settings)


@dataclass
class ArmState:
    """One arm during a run: its chat, committed history, session, and why it stopped."""

    arm: Arm
    chat: ChatTemplate
    history_ids: list[int] = field(default_factory=list)
    store: SessionStore | None = None
    sid: str | None = None
    stopped: str | None = None  # why this arm stopped early
    proposer: object | None = None  # the speculative arm's proposer (rebuilt on resume)


@dataclass
class Progress:
    """Where a run is: the rows so far, the next turn, the wall time spent, each arm's state."""

    rows: list[dict]
    next_turn: int
    wall_s: float
    plant_len: dict[str, int]
    states: dict[str, ArmState]


def new_session(loaded, arm: Arm) -> tuple[SessionStore, str]:
    store = SessionStore(loaded.model, arm.config, capacity=1)
    return store, store.create()


def new_proposer(loaded, arm: Arm):
    """The arm's proposer (None for plain decoding). It resynchronises from the context
    it is given, so a fresh one serves a resumed run."""
    if arm.proposer is None:
        return None
    from kakeya_lab.proposers import make_proposer

    return make_proposer(
        arm.proposer,
        loaded.model,
        arm.config,
        loaded.tokenizer,
        verifier_sha256=loaded.description.weight_sha256,
    )


def fresh_progress(loaded, arms: Mapping[str, Arm]) -> Progress:
    states = {}
    for name, arm in arms.items():
        state = ArmState(arm, ChatTemplate(loaded.tokenizer), proposer=new_proposer(loaded, arm))
        if not arm.stateless:
            state.store, state.sid = new_session(loaded, arm)
        states[name] = state
    return Progress(rows=[], next_turn=0, wall_s=0.0, plant_len={}, states=states)


def load_progress(path: Path, loaded, arms: Mapping[str, Arm], settings: dict) -> Progress:
    """Resume from ``path``; raises :class:`~kakeya_lab.resume.ResumeMismatch` if it was
    made with other settings, :class:`~kakeya_lab.resume.DamagedCheckpoint` if it does not
    read back whole."""
    saved = check_checkpoint(path, settings)
    states = {}
    for name, arm in arms.items():
        s = saved["arms"][name]
        state = ArmState(
            arm,
            ChatTemplate.from_state(loaded.tokenizer, s["chat"]),
            list(s["history_ids"]),
            stopped=s["stopped"],
            proposer=new_proposer(loaded, arm),
        )
        if not arm.stateless and state.history_ids:
            state.store, state.sid = new_session(loaded, arm)
            state.store.append(state.sid, state.history_ids)  # replay: same cache as before
        elif not arm.stateless:
            state.store, state.sid = new_session(loaded, arm)
        states[name] = state
    return Progress(
        rows=saved["rows"],
        next_turn=saved["next_turn"],
        wall_s=saved["wall_s"],
        plant_len=saved.get("plant_len", {}),
        states=states,
    )


def save_progress(path: Path, progress: Progress, settings: dict) -> None:
    write_json_atomic(
        path,
        {
            "settings": settings,
            "next_turn": progress.next_turn,
            "wall_s": progress.wall_s,
            "plant_len": progress.plant_len,
            "rows": progress.rows,
            "arms": {
                n: {"history_ids": s.history_ids, "chat": s.chat.to_state(), "stopped": s.stopped}
                for n, s in progress.states.items()
            },
        },
    )


def start_over(out_dir: Path) -> None:
    """Remove a previous run's outputs from ``out_dir`` (``--force-new``)."""
    for name in OUTPUTS:
        (out_dir / name).unlink(missing_ok=True)
