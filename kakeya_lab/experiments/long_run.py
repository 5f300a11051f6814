"""A long run as a run folder: ``run.json`` kept current for the run's whole life, the
report (``metrics.json``) written at every checkpoint, the results index refreshed at the end.

* :func:`record_long_run` — the in-process arms (:func:`~kakeya_lab.bench.long_run.run_long`:
  checkpointed, resumed when run again, stopped by SIGTERM or SIGINT with a partial report);
* :func:`record_served_long_run` — the served arms against a running ``kakeya-lab serve``
  (not checkpointed: written once, at its end).

``run.json`` (:class:`~kakeya_lab.experiments.run_record.CliRunRecord`) goes ``running`` →
``completed``, ``partial`` (a signal stopped the run: run the same command to resume) or
``failed`` (the error says why); a resume refused for other settings leaves the folder's
record as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kakeya_lab.experiments.index import index_results_root
from kakeya_lab.experiments.run_record import CliRunRecord

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run import Arm, LongRun
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
    arms: Mapping[str, Arm],
    turns: Sequence[str],
    out_dir: Path,
    invocation: Invocation,
    **options: Any,
) -> LongRun:
    """:func:`~kakeya_lab.bench.long_run.run_long` into ``out_dir`` with its ``run.json``
    and a report at every checkpoint. ``options``: ``run_long``'s keyword arguments
    (``max_new_tokens``, ``duration_s``, ``probe``, ...; not ``out_dir`` or ``on_report``).

    Returns the run (its :func:`outcome` is recorded); errors of ``run_long`` propagate
    after the record says ``failed`` (``partial`` for a second Ctrl-C; untouched for
    :class:`~kakeya_lab.resume.ResumeMismatch`)."""
    from kakeya_lab.bench.long_run import DegenerateRun, long_run_headline, run_long
    from kakeya_lab.results import run_header, write_metrics
    from kakeya_lab.resume import ResumeMismatch

    header = run_header(
        experiment=EXPERIMENT,
        run_id=out_dir.resolve().name,
        model=loaded.description,
        cache=arms[next(iter(arms))].config.to_dict(),
        extra={
            "arms": list(arms),
            "turns": len(turns),
            "max_new_tokens": options.get("max_new_tokens"),
            "turn_spacing_s": options.get("turn_spacing_s"),
            "duration_limit_s": options.get("duration_s"),
        },
    )
    record = CliRunRecord(
        out_dir,
        experiment=EXPERIMENT,
        command=invocation.command,
        parameters=invocation.parameters,
    )

    def write_report(run: LongRun) -> None:
        fields = run.report_fields()
        write_metrics(
            out_dir,
            header,
            {**fields, "arms": run.summary},
            headline={**long_run_headline(run.summary), **fields},
        )
        if run.partial and run.abort_reason is None:
            record.progress(turns=int(run.turns["turn"].max()) + 1, duration_s=run.duration_s)

    record.start()
    try:
        run = run_long(loaded, arms, turns, out_dir=out_dir, on_report=write_report, **options)
    except DegenerateRun as exc:
        record.finish("failed", " ".join(str(exc).split()), type(exc).__name__)
        raise
    except ResumeMismatch:
        record.restore()  # the folder's run is untouched: its record stays as it was
        raise
    except KeyboardInterrupt:
        record.finish("partial", "KeyboardInterrupt (a second Ctrl-C)", "KeyboardInterrupt")
        raise
    except Exception as exc:
        record.finish("failed", f"{type(exc).__name__}: {exc}", type(exc).__name__)
        raise
    status, message = outcome(run)
    record.finish(status, message)
    index_results_root(out_dir)
    return run


def record_served_long_run(
    grpc_target: str,
    http_base: str,
    turns: Sequence[str],
    out_dir: Path,
    invocation: Invocation,
    *,
    model: Mapping[str, Any],
    served_model: str,
    server_cache: dict,
    arms: list[str],
    max_new_tokens: int,
    turn_spacing_s: float | None,
    duration_s: float | None,
    stateless_cap_s: float | None,
    turns_per_bucket: int,
    seconds_per_bucket: float,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """The served ``arms`` against a running server into ``out_dir`` (``turns.csv``,
    ``metrics.json``, ``run.json``; the index refreshed). ``model``: the identity the
    header records (``name``, ``weight_sha256``, ...); ``served_model`` the server's model
    id. Returns the summary by arm; any error propagates after ``run.json`` says ``failed``."""
    from kakeya_lab.bench.long_run.served import summarize_served
    from kakeya_lab.bench.long_run.summary import long_run_headline
    from kakeya_lab.durable import write_csv_atomic
    from kakeya_lab.results import run_header, write_metrics
    from kakeya_lab.serve.served_long_run import run_served_long_run

    header = run_header(
        experiment=EXPERIMENT,
        run_id=out_dir.resolve().name,
        model=dict(model),
        extra={
            "arms": arms,
            "turns": len(turns),
            "max_new_tokens": max_new_tokens,
            "endpoints": {"grpc": grpc_target, "http": http_base},
            "server_cache": server_cache,
            "turn_spacing_s": turn_spacing_s,
            "duration_s": duration_s,
            "stateless_cap_s": stateless_cap_s,
        },
    )
    record = CliRunRecord(
        out_dir,
        experiment=EXPERIMENT,
        command=invocation.command,
        parameters=invocation.parameters,
    )
    record.start()
    try:
        table = run_served_long_run(
            grpc_target,
            http_base,
            turns,
            max_new_tokens=max_new_tokens,
            model=served_model,
            arms=arms,
            turn_spacing_s=turn_spacing_s,
            duration_s=duration_s,
            stateless_cap_s=stateless_cap_s,
            log=log,
        )
    except BaseException as exc:
        record.finish("failed", f"{type(exc).__name__}: {exc}", type(exc).__name__)
        raise
    summary = summarize_served(
        table,
        server_cache,
        turns_per_bucket=turns_per_bucket,
        seconds_per_bucket=seconds_per_bucket,
    )
    wall = table["wall_s"].dropna()
    fields = {
        "partial": False,
        "abort_reason": None,
        "duration_s": float(wall.max()) if len(wall) else 0.0,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out_dir / "turns.csv", table)
    write_metrics(
        out_dir,
        header,
        {**fields, "arms": summary},
        headline={**long_run_headline(summary), **fields},
    )
    record.finish("completed")
    index_results_root(out_dir)
    return summary
