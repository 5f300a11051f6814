"""The one writer of a long run's report: ``metrics.json`` (and the served arms' table and
the figures) in its run folder.

The CLI (at every checkpoint and at the end, :mod:`kakeya_lab.experiments.long_run`) and
notebook 20 (its save cell) both call :func:`save_long_run`, so a run folder holds the same
files with the same keys whichever made it. ``metrics.json``: the header
(:func:`~kakeya_lab.results.run_header`, whose ``proposer`` is the speculative arm's spec
and draft length) with ``settings`` (:meth:`LongRunSettings.to_dict`), ``linear`` (the
in-process arms' kernel), ``arms``, ``turns``, ``max_new_tokens``, ``turn_spacing_s``, ``duration_limit_s`` (and for
served arms ``served_arms``, ``server_cache``, ``endpoints``); ``metrics``: ``partial``,
``abort_reason``, ``duration_s`` and ``arms`` (every arm's summary); ``headline``: the
index's numbers per arm plus the three run fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kakeya_lab.bench.long_run.summary import long_run_headline
from kakeya_lab.results import run_header, write_run

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run.driver import LongRun
    from kakeya_lab.bench.long_run.served import ServedRun
    from kakeya_lab.bench.long_run.settings import LongRunSettings

EXPERIMENT = "long_run"
FIGURES = ("kv_bytes", "latency", "rss", "recall", "served_prefill")


def run_fields(run: LongRun | None, served: ServedRun | None) -> dict[str, Any]:
    """``partial``, ``abort_reason`` and ``duration_s`` of the run (the in-process run's
    when there is one, else the served run's)."""
    if run is not None:
        return run.report_fields()
    if served is None:
        return {"partial": False, "abort_reason": None, "duration_s": 0.0}
    return served.report_fields()


def kernel_of(settings: LongRunSettings, run: LongRun | None) -> str | None:
    """The linear kernel the in-process arms ran on (a torch model's; :func:`run_long`
    checks it is ``settings.linear``); None without in-process arms (a served run's kernel
    is the server's) or on another backend."""
    return settings.linear if run is not None and settings.backend == "torch" else None


def proposer_of(settings: LongRunSettings) -> dict[str, Any] | None:
    """The speculative arm's proposer spec and draft length (None without that arm); for a
    served-only run, the proposer its requests name (``served_proposer``), marked
    ``served``."""
    if "speculative" in settings.arms:
        return {"spec": settings.proposer, "draft_length": settings.draft_length}
    if settings.served_proposer is not None:
        return {
            "spec": settings.served_proposer,
            "draft_length": settings.draft_length,
            "served": True,
        }
    return None


def save_long_run(
    run_dir: str | Path,
    settings: LongRunSettings,
    model: Any,
    *,
    run: LongRun | None = None,
    served: ServedRun | None = None,
    experiment: str = EXPERIMENT,
    run_id: str | None = None,
    started: str | None = None,
    figures: bool = False,
) -> Path:
    """Write the report of ``run`` (in-process arms, whose own ``turns.csv`` and checkpoint
    :func:`~kakeya_lab.bench.long_run.run_long` keeps) and/or ``served`` (served arms:
    also ``served_turns.csv``) into ``run_dir``; return the path of ``metrics.json``.

    ``model``: the loaded model's description (``loaded.description``) or a dict with its
    ``name`` and ``weight_sha256``. ``run_id``: default the folder's name. ``figures``:
    also the standalone HTML figures (:data:`FIGURES`, those that apply).
    Raises ValueError when neither run is given."""
    if run is None and served is None:
        raise ValueError("save_long_run: give the in-process run, the served run, or both")
    out = Path(run_dir)
    summary = {**(run.summary if run is not None else {}), **(served.summary if served else {})}
    fields = run_fields(run, served)
    first_arm = next(iter(run.arms.values()), None) if run is not None else None
    cache = first_arm.config.to_dict() if first_arm is not None else (served and served.cache)
    extra: dict[str, Any] = {
        "settings": settings.to_dict(),
        "linear": kernel_of(settings, run),
        "arms": list(run.arms) if run is not None else [],
        "turns": settings.turns,
        "max_new_tokens": settings.max_new_tokens,
        "turn_spacing_s": settings.turn_spacing_s,
        "duration_limit_s": settings.duration_s,
    }
    if served is not None:
        extra.update(
            served_proposer=(
                {"spec": settings.served_proposer, "draft_length": settings.draft_length}
                if settings.served_proposer is not None
                else None
            ),
            served_arms=list(settings.served_arms),
            server_cache=served.cache,
            endpoints={"grpc": served.endpoints.grpc_target, "http": served.endpoints.http_base},
        )
    header = run_header(
        experiment=experiment,
        run_id=run_id or out.resolve().name,
        model=model,
        cache=cache or None,
        proposer=proposer_of(settings),
        started=started,
        extra=extra,
    )
    metrics: dict[str, Any] = {**fields, "arms": summary}
    if served is not None:
        metrics["served_events"] = served.events
        metrics["served_errors"] = {
            "failed_turns": int(sum(s.get("errors") or 0 for s in served.summary.values())),
            "max_errors": settings.max_errors,
        }
    return write_run(
        out,
        header,
        metrics,
        headline={**long_run_headline(summary), **fields},
        tables={"served_turns": served.turns} if served is not None else None,
        figures=long_run_figures(settings, summary, run, served) if figures else None,
    )


def long_run_figures(
    settings: LongRunSettings,
    summary: dict[str, dict],
    run: LongRun | None,
    served: ServedRun | None,
) -> dict[str, Any]:
    """The run folder's figures by name (:data:`FIGURES`, those that apply)."""
    import pandas as pd

    from kakeya_lab.plots import (
        kv_bytes_figure,
        prefill_figure,
        recall_figure,
        rss_figure,
        turn_latency_figure,
    )

    table = pd.concat([r.turns for r in (run, served) if r is not None], ignore_index=True)
    budget = (summary.get("sink_window") or next(iter(summary.values()))).get("budget_bytes")
    figs = {
        "kv_bytes": kv_bytes_figure(table, budget_bytes=budget),
        "latency": turn_latency_figure(table),
        "rss": rss_figure(table),
        "recall": recall_figure(table, window=settings.window),
    }
    if served is not None:
        figs["served_prefill"] = prefill_figure(served.turns)
    return figs


def save_quickstart(
    run_dir: str | Path,
    settings: LongRunSettings,
    model: Any,
    run: LongRun,
    *,
    budget_bytes: int,
    experiment: str = "quickstart",
    run_id: str | None = None,
    started: str | None = None,
    figures: dict[str, Any] | None = None,
) -> Path:
    """The quickstart's run folder (notebook 00: a short long run of two arms on a fixed
    script): ``metrics.json`` (every arm's summary, the sink-window arm's analytic
    ``budget_bytes``; headline ``kv_bounded``, ``prefill_bounded``, ``prefill_flat_vs_history`` and
    ``kv_live_bytes_last`` per arm),
    ``turns.csv`` and ``figures``. Returns the path of ``metrics.json``."""
    out = Path(run_dir)
    header = run_header(
        experiment=experiment,
        run_id=run_id or out.resolve().name,
        model=model,
        dtype="float32",
        cache=next(iter(run.arms.values())).config.to_dict(),
        started=started,
        extra={"settings": settings.to_dict()},
    )
    metrics = {
        "arms": run.summary,
        "budget_bytes": budget_bytes,
        "parameters": {"turns": settings.turns, "max_new_tokens": settings.max_new_tokens},
    }
    table = run.turns
    headline = {
        arm: {
            "kv_bounded": s["kv_bounded"],
            "prefill_bounded": s.get("prefill_bounded"),
            "prefill_flat_vs_history": s.get("prefill_flat_vs_history"),
            "kv_live_bytes_last": int(table[table.arm == arm].kv_live_bytes.iloc[-1]),
        }
        for arm, s in run.summary.items()
    }
    return write_run(
        out, header, metrics, headline=headline, tables={"turns": table}, figures=figures
    )
