"""The long-run driver: every arm through the same user turns, alternating turn by turn,
checkpointed, resumable (strictly), refusing meaningless results."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from kakeya_lab.backends.config import analytic_kv_budget_bytes
from kakeya_lab.bench.long_run.arms import Arm, arms_for
from kakeya_lab.bench.long_run.checkpoint import (
    ArmState,
    Progress,
    fresh_progress,
    load_progress,
    loaded_kernel,
    run_settings,
    save_progress,
    start_over,
)
from kakeya_lab.bench.long_run.probe import FactProbe
from kakeya_lab.bench.long_run.records import refuse_all_failed, refuse_degenerate
from kakeya_lab.bench.long_run.settings import CHECKPOINT, LongRunSettings
from kakeya_lab.bench.long_run.summary import summarize_long_run
from kakeya_lab.bench.long_run.turn import run_turn
from kakeya_lab.durable import write_csv_atomic
from kakeya_lab.session import SessionStore, model_eos_ids


@dataclass
class LongRun:
    """A run's report: the per-turn table, the arms, their summaries. ``partial``: the run
    is not over (a periodic report, or a run stopped by a signal, ``abort_reason`` then
    names it, e.g. ``"SIGTERM"``); ``duration_s``: wall time of the run so far."""

    turns: pd.DataFrame
    arms: dict[str, Arm]
    summary: dict[str, dict]
    states: dict[str, ArmState]
    partial: bool = False
    abort_reason: str | None = None
    duration_s: float = 0.0

    def report_fields(self) -> dict:
        """The run-level report fields: ``partial``, ``abort_reason``, ``duration_s``."""
        return {
            "partial": self.partial,
            "abort_reason": self.abort_reason,
            "duration_s": self.duration_s,
        }

    def session(self, arm: str) -> tuple[SessionStore, str]:
        state = self.states[arm]
        if state.store is None or state.sid is None:
            raise ValueError(
                f"arm {arm!r} has no session: a stateless arm opens one per turn and ran none"
            )
        return state.store, state.sid


class StoppedBeforeStart(Exception):
    """SIGTERM or SIGINT arrived while a run was being set up (its checkpoint read and
    replayed): the run stopped before its first turn and wrote nothing. ``signal``: the
    signal's name, e.g. ``"SIGTERM"``."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} before the first turn; nothing was written")
        self.signal = signal_name


# What signal.signal() accepts and returns.
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class StopSignals:
    """SIGTERM / SIGINT set a flag that the driver checks between turns (the turn under
    way finishes first). Installed only in the main thread; restored on exit."""

    def __init__(self) -> None:
        self.caught: str | None = None
        self._old: dict[int, _Handler] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._catch)
        return self

    def _catch(self, signum: int, frame) -> None:
        if self.caught is not None and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.caught = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def run_long(
    loaded,
    settings: LongRunSettings,
    user_turns: Sequence[str] | None = None,
    *,
    out_dir: str | Path | None = None,
    on_report: Callable[[LongRun], None] | None = None,
    catch_signals: bool = True,
    force_new: bool = False,
    progress: bool = True,
    on_start: Callable[[], None] | None = None,
) -> LongRun:
    """Drive every arm of ``settings`` through ``user_turns`` (default: the standard script,
    :meth:`LongRunSettings.user_turns`; else exactly ``settings.turns`` of them), cycled
    when ``settings.duration_s`` asks for more.

    With ``out_dir`` the run checkpoints there every ``settings.checkpoint_every`` turns
    and every ``settings.report_every_s`` seconds of wall time, and resumes from an
    existing checkpoint — only with the same model and linear kernel, arms, caches,
    proposer and draft length, generation settings and turns (else
    :class:`~kakeya_lab.resume.ResumeMismatch` names the difference; a checkpoint that does
    not read back whole is a :class:`~kakeya_lab.resume.DamagedCheckpoint`; both before
    anything is written); ``force_new`` starts over instead. Every checkpoint also writes ``turns.csv`` and calls
    ``on_report`` with a partial :class:`LongRun` (``partial=True``); the end of the run
    calls it once more.

    ``settings.turn_spacing_s``: round ``i`` starts ``i * turn_spacing_s`` seconds after
    the run's origin (at once if it is already late). ``settings.duration_s``: no round
    starts after that wall time. ``catch_signals``: SIGTERM / SIGINT stop the run after the
    turn under way, save the checkpoint, and return a report with ``partial=True`` and
    ``abort_reason`` the signal's name (a second SIGINT raises KeyboardInterrupt at once).
    A signal while the checkpoint is read and replayed (before the first turn) raises
    :class:`StoppedBeforeStart` instead, with nothing written. ``on_start`` is called once
    that setup is done, just before the first turn (e.g. to mark a run record running).

    ``settings.linear`` must be the kernel the loaded torch model runs (ValueError
    otherwise): it is part of the run's identity (a latency series on one kernel).

    Raises :class:`~kakeya_lab.bench.long_run.records.DegenerateRun` on meaningless
    numbers (zero KV bytes, every turn failed). A failing turn stops its arm; the others go on.
    """
    turns = settings.user_turns() if user_turns is None else list(user_turns)
    if len(turns) != settings.turns:
        raise ValueError(
            f"{len(turns)} user turns given for settings.turns={settings.turns}: give as many"
        )
    kernel = loaded_kernel(loaded)
    if kernel and kernel != settings.linear:
        raise ValueError(
            f"the model's linear layers run {kernel!r} but settings.linear is "
            f"{settings.linear!r}: load it with load_model(..., linear=settings.linear)"
        )
    arms = arms_for(settings)
    probe = settings.probe()
    saved = run_settings(loaded, arms, turns, settings)
    out = Path(out_dir) if out_dir is not None else None
    checkpoint = out / CHECKPOINT if out is not None else None
    spacing_s, report_every_s = settings.turn_spacing_s, settings.report_every_s

    def report(wall_s: float, partial: bool, abort_reason: str | None = None) -> LongRun:
        if checkpoint is not None:
            refuse_degenerate(state.rows)
            state.wall_s = wall_s
            save_progress(checkpoint, state, saved)
        run = _finish(loaded, arms, state, out, settings)
        run.partial, run.abort_reason, run.duration_s = partial, abort_reason, wall_s
        if on_report is not None and state.rows:
            on_report(run)
        return run

    with StopSignals() if catch_signals else NoSignals() as signals:
        # A signal while the checkpoint is read and replayed stops the run before it
        # starts: nothing was written, so the folder stays as it was.
        try:
            if checkpoint is not None and checkpoint.exists() and not force_new:
                state = load_progress(checkpoint, loaded, arms, saved)
            else:
                if out is not None and force_new:
                    start_over(out)
                state = fresh_progress(loaded, arms)
        except KeyboardInterrupt:  # a second Ctrl-C during the replay
            raise StoppedBeforeStart("SIGINT") from None
        if signals.caught:
            raise StoppedBeforeStart(signals.caught)
        if on_start is not None:
            on_start()
        t0 = time.perf_counter() - state.wall_s
        last_report = time.perf_counter()
        limit = len(turns) if settings.duration_s is None else None
        bar = tqdm(
            total=limit,
            initial=state.next_turn,
            desc="long run",
            unit="turn",
            disable=not progress,
        )
        while (limit is None or state.next_turn < limit) and not signals.caught:
            if spacing_s is not None:
                wait_until(t0 + state.next_turn * spacing_s, signals)
                if signals.caught:
                    break
            if settings.duration_s is not None and time.perf_counter() - t0 >= settings.duration_s:
                break
            _run_round(
                loaded, state, turns, settings.max_new_tokens, t0, probe, settings.reprefill_cap_s
            )
            bar.update(1)
            now = time.perf_counter()
            due_by_time = report_every_s is not None and now - last_report >= report_every_s
            if state.next_turn % settings.checkpoint_every == 0 or due_by_time:
                report(now - t0, partial=True)
                last_report = now  # by wall time: the report's own writing counts
        bar.close()
        reason = signals.caught
        final = report(time.perf_counter() - t0, partial=reason is not None, abort_reason=reason)
    refuse_degenerate(state.rows)
    if reason is None:
        refuse_all_failed(state.rows)
    return final


class NoSignals:
    caught: str | None = None

    def __enter__(self) -> NoSignals:
        return self

    def __exit__(self, *exc) -> None:
        return None


def wait_until(when: float, signals) -> None:
    """Sleep until ``time.perf_counter() >= when``, waking early on a caught signal."""
    while not signals.caught:
        left = when - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.1))


def _run_round(
    loaded,
    state: Progress,
    turns: list[str],
    max_new_tokens: int,
    t0: float,
    probe: FactProbe | None,
    reprefill_cap_s: float | None,
) -> None:
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
            row = asdict(
                run_turn(
                    loaded,
                    arm_state,
                    text,
                    i,
                    max_new_tokens,
                    t0,
                    probe,
                    state.plant_len.get(name, 0),
                    eos_ids,
                )
            )
        except Exception as exc:  # recorded; the arm stops, the others go on
            arm_state.stopped = f"turn {i}: {type(exc).__name__}: {exc}"
            state.rows.append(
                {
                    "arm": name,
                    "turn": i,
                    "error": arm_state.stopped,
                    "wall_s": time.perf_counter() - t0,
                }
            )
            continue
        state.rows.append(row)
        took = row["append_latency_s"] + row["generate_s"]
        if arm_state.arm.stateless and reprefill_cap_s is not None and took > reprefill_cap_s:
            arm_state.stopped = (
                f"stopped after turn {i}: a turn took longer than {reprefill_cap_s}s"
            )
    state.next_turn = i + 1


def _finish(
    loaded,
    arms: Mapping[str, Arm],
    state: Progress,
    out: Path | None,
    settings: LongRunSettings,
) -> LongRun:
    table = pd.DataFrame(state.rows)
    if "error" not in table:
        table["error"] = None
    if "arm" not in table:
        table["arm"] = pd.Series(dtype=str)
    budgets = {n: analytic_kv_budget_bytes(loaded.model, a.config) for n, a in arms.items()}
    summary = summarize_long_run(
        table,
        arms,
        budgets,
        turns_per_bucket=settings.turns_per_bucket,
        seconds_per_bucket=settings.seconds_per_bucket,
        prefill_tolerance=settings.prefill_tolerance,
        prefill_direction=settings.prefill_direction,
    )
    for name, arm_state in state.states.items():
        summary[name]["stopped"] = arm_state.stopped
    if out is not None:
        write_csv_atomic(out / "turns.csv", table)
    return LongRun(turns=table, arms=dict(arms), summary=summary, states=state.states)
