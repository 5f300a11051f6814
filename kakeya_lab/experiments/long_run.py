"""A long run as a run folder: ``run.json`` kept current for the run's whole life, the
report (``metrics.json``) written at every checkpoint, the results index refreshed at the end.

* :func:`record_long_run` — the in-process arms (:func:`~kakeya_lab.bench.long_run.run_long`:
  checkpointed, resumed when run again, stopped by SIGTERM or SIGINT with a partial report);
* :func:`record_served_long_run` — the served arms against a running ``kakeya-lab serve``
  (the same life: checkpointed, resumed, a partial report on a signal; failed turns
  counted up to an error budget).

``run.json`` (:class:`~kakeya_lab.experiments.run_record.RunRecord`) goes ``running`` →
``completed``, ``partial`` (a signal stopped the run: run the same command to resume) or
``failed`` (the error says why); a resume refused for other settings or a damaged
checkpoint, or stopped by a signal before its first turn, leaves the folder's record as it
was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kakeya_lab.experiments.index import index_results_root
from kakeya_lab.experiments.run_record import RunRecord

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run import LongRun, LongRunSettings
    from kakeya_lab.bench.long_run.served import Endpoints, ServedRun
    from kakeya_lab.models import LoadedModel

EXPERIMENT = "long_run"


@dataclass(frozen=True)
class Invocation:
    """What started a run, for its ``run.json``: the command line and every option."""

    command: list[str]
    parameters: dict[str, Any]


def failed_arms(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The arms that stopped on a failing turn."""
    return [arm for arm, s in summary.items() if s.get("errors")]


def outcome(run: LongRun) -> tuple[str, str | None]:
    """The record status of a finished :func:`run_long` and what it says: ``partial``
    (stopped by a signal), ``failed`` (an arm stopped on a failing turn) or ``completed``."""
    if run.abort_reason is not None:
        return "partial", f"stopped by {run.abort_reason}; run the same command to resume"
    failed = failed_arms(run.summary)
    if failed:
        return "failed", f"arm(s) {', '.join(failed)} stopped on a failing turn (see turns.csv)"
    return "completed", None


def record_long_run(
    loaded: LoadedModel,
    settings: LongRunSettings,
    out_dir: Path,
    invocation: Invocation,
    *,
    user_turns: Sequence[str] | None = None,
    force_new: bool = False,
    progress: bool = True,
) -> LongRun:
    """:func:`~kakeya_lab.bench.long_run.run_long` into ``out_dir`` with its ``run.json``
    and a report (:func:`~kakeya_lab.bench.long_run.save_long_run`, the writer notebook 20
    uses too) at every checkpoint.

    Returns the run (its :func:`outcome` is recorded). ``run.json`` says ``running`` from
    the first turn on (the checkpoint read and replayed); errors of ``run_long`` propagate
    after the record says ``failed`` (``partial`` for a second Ctrl-C during the turns). A
    run refused or failing before its first turn — a :class:`~kakeya_lab.resume.ResumeError`
    (other settings, a damaged checkpoint), a signal during the setup
    (:class:`~kakeya_lab.bench.long_run.StoppedBeforeStart`), any other error — leaves an
    existing ``run.json`` as it was."""
    from kakeya_lab.bench.long_run import DegenerateRun, StoppedBeforeStart, run_long, save_long_run
    from kakeya_lab.results import now_iso
    from kakeya_lab.resume import ResumeError

    started = now_iso()
    record = RunRecord(
        out_dir,
        experiment=EXPERIMENT,
        command=invocation.command,
        parameters=invocation.parameters,
    )
    begun = False

    def begin() -> None:
        nonlocal begun
        record.start()
        begun = True

    def write_report(run: LongRun) -> None:
        save_long_run(out_dir, settings, loaded.description, run=run, started=started)
        if run.partial and run.abort_reason is None:
            record.progress(turns=int(run.turns["turn"].max()) + 1, duration_s=run.duration_s)

    try:
        run = run_long(
            loaded,
            settings,
            user_turns,
            out_dir=out_dir,
            on_report=write_report,
            force_new=force_new,
            progress=progress,
            on_start=begin,
        )
    except (ResumeError, StoppedBeforeStart):
        raise  # refused before the first turn, before the record was touched
    except DegenerateRun as exc:
        _fail(record, begun, "failed", " ".join(str(exc).split()), type(exc).__name__)
        raise
    except KeyboardInterrupt:
        _fail(record, begun, "partial", "KeyboardInterrupt (a second Ctrl-C)", "KeyboardInterrupt")
        raise
    except Exception as exc:
        _fail(record, begun, "failed", f"{type(exc).__name__}: {exc}", type(exc).__name__)
        raise
    status, message = outcome(run)
    record.finish(status, message)
    index_results_root(out_dir)
    return run


def _fail(record: RunRecord, begun: bool, status: str, message: str, error_type: str) -> None:
    """End ``record`` with ``status``. An error before the first turn leaves a folder's
    existing record as it was (that run is where it was); a new folder gets a record of
    the failed start."""
    if not begun:
        if record.path.exists():
            return
        record.start()
    record.finish(status, message, error_type)


def served_outcome(served: ServedRun) -> tuple[str, str | None]:
    """The record status of a finished served run and what it says: ``partial`` (a signal
    stopped it: run the same command to resume), ``failed`` (past the error budget) or
    ``completed`` (failed turns, if any, are counted in the report)."""
    if served.abort_reason == "max_errors":
        return "failed", f"stopped: {served.abort_detail}"
    if served.abort_reason is not None:
        return "partial", f"stopped by {served.abort_reason}; run the same command to resume"
    return "completed", None


def record_served_long_run(
    endpoints: Endpoints,
    settings: LongRunSettings,
    out_dir: Path,
    invocation: Invocation,
    *,
    model: Mapping[str, Any],
    log: Callable[[str], None] | None = None,
    force_new: bool = False,
    restart_wait_s: float = 120.0,
) -> ServedRun:
    """``settings.served_arms`` against the running server at ``endpoints``
    (:func:`~kakeya_lab.bench.long_run.served.run_served`: checkpointed, resumed when run
    again, stopped by SIGTERM or SIGINT with a partial report) into ``out_dir``
    (``served_turns.csv`` and ``metrics.json`` by
    :func:`~kakeya_lab.bench.long_run.save_long_run` at every checkpoint and at the end,
    ``run.json``; the index refreshed). ``model``: the identity the header and the
    checkpoint record (``name``, ``weight_sha256``, ...). Returns the run (its
    :func:`served_outcome` is recorded). A resume refused (other settings, a damaged
    checkpoint) or stopped before its first turn leaves an existing ``run.json`` as it
    was; any other error propagates after ``run.json`` says ``failed``."""
    from kakeya_lab.bench.long_run import StoppedBeforeStart, save_long_run
    from kakeya_lab.bench.long_run.served import run_served
    from kakeya_lab.results import now_iso
    from kakeya_lab.resume import ResumeError

    started = now_iso()
    record = RunRecord(
        out_dir,
        experiment=EXPERIMENT,
        command=invocation.command,
        parameters=invocation.parameters,
    )
    begun = False

    def begin() -> None:
        nonlocal begun
        record.start()
        begun = True

    def write_report(served: ServedRun) -> None:
        save_long_run(out_dir, settings, dict(model), served=served, started=started)
        if served.partial and served.abort_reason is None:
            record.progress(turns=int(served.turns["turn"].max()) + 1, duration_s=served.duration_s)

    identity = {"name": model["name"], "weight_sha256": model["weight_sha256"]}
    try:
        served = run_served(
            endpoints,
            settings,
            log=log,
            out_dir=out_dir,
            on_report=write_report,
            force_new=force_new,
            on_start=begin,
            restart_wait_s=restart_wait_s,
            model_identity=identity,
        )
    except (ResumeError, StoppedBeforeStart):
        raise
    except KeyboardInterrupt:
        _fail(record, begun, "partial", "KeyboardInterrupt (a second Ctrl-C)", "KeyboardInterrupt")
        raise
    except BaseException as exc:
        _fail(record, begun, "failed", f"{type(exc).__name__}: {exc}", type(exc).__name__)
        raise
    status, message = served_outcome(served)
    record.record["abort_reason"] = served.abort_reason
    record.finish(
        status, message, "ErrorBudget" if served.abort_reason == "max_errors" else "RunFailed"
    )
    index_results_root(out_dir)
    return served
