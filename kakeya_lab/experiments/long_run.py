"""A long run as a run folder: ``run.json`` kept current for the run's whole life, the
report (``metrics.json``) written at every checkpoint, the results index refreshed at the end.

* :func:`record_long_run` — the in-process arms (:func:`~kakeya_lab.bench.long_run.run_long`:
  checkpointed, resumed when run again, stopped by SIGTERM or SIGINT with a partial report);
* :func:`record_served_long_run` — the served arms against a running ``kakeya-lab serve``
  (not checkpointed: written once, at its end).

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
    from kakeya_lab.bench.long_run.served import Endpoints
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


def record_served_long_run(
    endpoints: Endpoints,
    settings: LongRunSettings,
    out_dir: Path,
    invocation: Invocation,
    *,
    model: Mapping[str, Any],
    log: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """``settings.served_arms`` against the running server at ``endpoints``
    (:func:`~kakeya_lab.bench.long_run.served.run_served`) into ``out_dir``
    (``served_turns.csv``, ``metrics.json`` by :func:`~kakeya_lab.bench.long_run.save_long_run`,
    ``run.json``; the index refreshed). ``model``: the identity the header records
    (``name``, ``weight_sha256``, ...). Returns the summary by arm; any error propagates
    after ``run.json`` says ``failed``."""
    from kakeya_lab.bench.long_run import save_long_run
    from kakeya_lab.bench.long_run.served import run_served
    from kakeya_lab.results import now_iso

    started = now_iso()
    record = RunRecord(
        out_dir,
        experiment=EXPERIMENT,
        command=invocation.command,
        parameters=invocation.parameters,
    )
    record.start()
    try:
        served = run_served(endpoints, settings, log=log)
        save_long_run(out_dir, settings, dict(model), served=served, started=started)
    except BaseException as exc:
        record.finish("failed", f"{type(exc).__name__}: {exc}", type(exc).__name__)
        raise
    record.finish("completed")
    index_results_root(out_dir)
    return served.summary
