"""The long-run driver: every arm through the same user turns, alternating turn by turn,
checkpointed, resumable (strictly), refusing meaningless results."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kakeya_lab.bench.long_run.arms import Arm
from kakeya_lab.bench.long_run.checkpoint import (
    CHECKPOINT,
    ArmState,
    Progress,
    fresh_progress,
    load_progress,
    run_settings,
    save_progress,
    start_over,
)
from kakeya_lab.bench.long_run.probe import FactProbe
from kakeya_lab.bench.long_run.records import refuse_all_failed, refuse_degenerate
from kakeya_lab.bench.long_run.summary import summarize_long_run
from kakeya_lab.bench.long_run.turn import run_turn
from kakeya_lab.cache import analytic_kv_budget_bytes
from kakeya_lab.durable import write_csv_atomic
from kakeya_lab.session import SessionStore, model_eos_ids


@dataclass
class LongRun:
    """A finished (or time-limited) run: the per-turn table, the arms, their summaries."""

    turns: pd.DataFrame
    arms: dict[str, Arm]
    summary: dict[str, dict]
    states: dict[str, ArmState]

    def session(self, arm: str) -> tuple[SessionStore, str]:
        state = self.states[arm]
        return state.store, state.sid


def check_run_arguments(
    *, turns: int, max_new_tokens: int, checkpoint_every: int, duration_s: float | None,
    reprefill_cap_s: float | None, turns_per_bucket: int,
) -> None:
    """Raise ValueError for any argument of :func:`run_long` that cannot work (no model needed)."""
    def integer(name: str, value: object, minimum: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

    def positive(name: str, value: object) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
                                  or value == float("inf")):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    integer("turns", turns, 1)
    integer("max_new_tokens", max_new_tokens, 1)
    integer("checkpoint_every", checkpoint_every, 1)
    integer("turns_per_bucket", turns_per_bucket, 1)
    positive("duration_s", duration_s)
    positive("reprefill_cap_s", reprefill_cap_s)


def run_long(
    loaded,
    arms: Mapping[str, Arm],
    user_turns: Sequence[str],
    *,
    max_new_tokens: int = 32,
    out_dir: str | Path | None = None,
    checkpoint_every: int = 10,
    duration_s: float | None = None,
    probe: FactProbe | None = None,
    reprefill_cap_s: float | None = 30.0,
    turns_per_bucket: int = 50,
    force_new: bool = False,
    progress: bool = True,
) -> LongRun:
    """Drive every arm through ``user_turns`` (cycled when ``duration_s`` asks for more).

    With ``out_dir`` the run checkpoints there every ``checkpoint_every`` turns and resumes
    from an existing checkpoint — only with the same model, arms, caches, generation
    settings and turns (else :class:`~kakeya_lab.resume.ResumeMismatch` names the
    difference); ``force_new`` starts over instead. Raises
    :class:`~kakeya_lab.bench.long_run.records.DegenerateRun` on meaningless numbers (zero
    KV bytes, every turn failed). A failing turn stops its arm; the others go on.
    """
    turns = list(user_turns)
    if not arms:
        raise ValueError("no arms to run")
    check_run_arguments(turns=len(turns), max_new_tokens=max_new_tokens, checkpoint_every=checkpoint_every,
                        duration_s=duration_s, reprefill_cap_s=reprefill_cap_s, turns_per_bucket=turns_per_bucket)
    settings = run_settings(loaded, arms, turns, max_new_tokens=max_new_tokens, probe=probe,
                            reprefill_cap_s=reprefill_cap_s, turns_per_bucket=turns_per_bucket)
    out = Path(out_dir) if out_dir is not None else None
    checkpoint = out / CHECKPOINT if out is not None else None
    if out is not None and force_new:
        start_over(out)
    if checkpoint is not None and checkpoint.exists():
        state = load_progress(checkpoint, loaded, arms, settings)
    else:
        state = fresh_progress(loaded, arms)

    def save(wall_s: float) -> None:
        if checkpoint is not None:
            refuse_degenerate(state.rows)
            state.wall_s = wall_s
            save_progress(checkpoint, state, settings)

    t0 = time.perf_counter() - state.wall_s
    limit = len(turns) if duration_s is None else None
    bar = tqdm(total=limit, initial=state.next_turn, desc="long run", unit="turn", disable=not progress)
    while (limit is None or state.next_turn < limit) and (duration_s is None or time.perf_counter() - t0 < duration_s):
        _run_round(loaded, state, turns, max_new_tokens, t0, probe, reprefill_cap_s)
        bar.update(1)
        if state.next_turn % checkpoint_every == 0:
            save(time.perf_counter() - t0)
    bar.close()
    save(time.perf_counter() - t0)
    refuse_degenerate(state.rows)
    refuse_all_failed(state.rows)
    return _finish(loaded, arms, state, out, turns_per_bucket)


def _run_round(loaded, state: Progress, turns: list[str], max_new_tokens: int, t0: float,
               probe: FactProbe | None, reprefill_cap_s: float | None) -> None:
    """Turn ``state.next_turn`` for every arm still running, then advance."""
    i = state.next_turn
    text = turns[i % len(turns)]
    if i == 0 and probe is not None:
        text = f"Please remember this: {probe.fact}. {text}"
    eos_ids = model_eos_ids(loaded.model)
    for name, arm_state in state.states.items():
        if arm_state.stopped:
            continue
        if i == 0:
            state.plant_len[name] = len(arm_state.history_ids)
        try:
            row = asdict(run_turn(loaded, arm_state, text, i, max_new_tokens, t0, probe,
                                  state.plant_len.get(name, 0), eos_ids))
        except Exception as exc:  # recorded; the arm stops, the others go on
            arm_state.stopped = f"turn {i}: {type(exc).__name__}: {exc}"
            state.rows.append({"arm": name, "turn": i, "error": arm_state.stopped,
                               "wall_s": time.perf_counter() - t0})
            continue
        state.rows.append(row)
        took = row["append_latency_s"] + row["generate_s"]
        if arm_state.arm.stateless and reprefill_cap_s is not None and took > reprefill_cap_s:
            arm_state.stopped = f"stopped after turn {i}: a turn took longer than {reprefill_cap_s}s"
    state.next_turn = i + 1


def _finish(loaded, arms: Mapping[str, Arm], state: Progress, out: Path | None, turns_per_bucket: int) -> LongRun:
    table = pd.DataFrame(state.rows)
    if "error" not in table:
        table["error"] = None
    budgets = {n: analytic_kv_budget_bytes(loaded.model, a.config) for n, a in arms.items()}
    summary = summarize_long_run(table, arms, budgets, turns_per_bucket=turns_per_bucket)
    for name, arm_state in state.states.items():
        summary[name]["stopped"] = arm_state.stopped
    if out is not None:
        write_csv_atomic(out / "turns.csv", table)
    return LongRun(turns=table, arms=dict(arms), summary=summary, states=state.states)
