"""The one writer of a speculative-decoding run folder and of a spec-table run folder.

Notebooks 30 and 35 save with one call each (:func:`save_speculative`,
:func:`save_spec_table`); a sweep's or a future CLI's run of the same family writes the
same files: ``metrics.json`` (the header with ``settings``, the family's
:class:`~kakeya_lab.settings.Settings` as a dict), the per-turn and per-step tables as
CSV, and the figures given.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kakeya_lab.bench.spec_table import long_table, table_records, targets_check, wide_table
from kakeya_lab.bench.speculative import greedy_streams_identical
from kakeya_lab.results import run_header, write_run

if TYPE_CHECKING:
    from kakeya_lab.bench.spec_table import SpecTable
    from kakeya_lab.bench.speculative import AssistedGeneration, SpeculativeRun
    from kakeya_lab.bench.speculative_settings import SpecTableSettings, SpeculativeSettings


def save_speculative(
    run_dir: str | Path,
    settings: SpeculativeSettings,
    model: Any,
    run: SpeculativeRun,
    *,
    hf: AssistedGeneration | None = None,
    experiment: str = "speculative",
    run_id: str | None = None,
    started: str | None = None,
    figures: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``run`` into ``run_dir``: ``metrics.json`` (every arm's summary, whether greedy
    decoding was lossless, the cost model, transformers' assisted generation ``hf``; the
    header names the kernel of the fastest plain decoding, every speedup's baseline),
    ``turns.csv``, ``steps.csv`` and ``figures``. ``model``: ``loaded.description``.
    Returns the path of ``metrics.json``."""
    out = Path(run_dir)
    header = run_header(
        experiment=experiment,
        run_id=run_id or out.resolve().name,
        model=model,
        dtype=settings.dtype,
        cache=settings.cache().to_dict(),
        proposer={"specs": list(settings.proposers), "draft_lengths": list(settings.draft_lengths)},
        seed=settings.seed,
        started=started,
        extra={
            "settings": settings.to_dict(),
            "temperature": settings.temperature,
            "prompt_set": settings.prompt_set,
            "linear": settings.linear,
            "plain_kernels": list(settings.plain_kernels),
            "plain_kernel": run.plain_kernel,
            "plain_tokens_per_s": run.plain_tokens_per_s,
        },
    )
    summary = run.summary.to_dict(orient="records")
    predicted = run.cost.arms.set_index("arm")["predicted_speedup"].to_dict() if run.cost else {}
    headline = {
        r["arm"]: {
            "tau": r["tau"],
            "speedup": r["speedup"],
            "acceptance_rate": r["acceptance_rate"],
            "expected_speedup": r["expected_speedup"],
            "predicted_speedup": predicted.get(r["arm"]),
        }
        for r in summary
    }
    lossless = bool(greedy_streams_identical(run.turns)) if settings.temperature == 0 else None
    metrics = {
        "arms": summary,
        "lossless": lossless,
        "hf_assisted": hf.to_dict() if hf else None,
        "cost_model": run.cost.to_dict() if run.cost else None,
    }
    tables = {"turns": run.turns.drop(columns=["reply_ids"]), "steps": run.steps}
    return write_run(
        out, header, metrics, headline=headline, tables=tables, figures=dict(figures or {})
    )


def save_spec_table(
    run_dir: str | Path,
    settings: SpecTableSettings,
    model: Any,
    table: SpecTable,
    *,
    targets: Mapping[str, float] | None = None,
    experiment: str = "spec_table",
    run_id: str | None = None,
    started: str | None = None,
    figures: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``table`` into ``run_dir``: ``metrics.json`` (:func:`table_records`, the wide
    table, the ``targets`` check), ``table.csv`` (the long table), ``turns_DOMAIN.csv`` and
    ``steps_DOMAIN.csv`` per domain, and ``figures``. Returns the path of ``metrics.json``."""
    out = Path(run_dir)
    draft_dtype = settings.draft_dtype or settings.dtype
    header = run_header(
        experiment=experiment,
        run_id=run_id or out.resolve().name,
        model=model,
        dtype=settings.dtype,
        cache={"sink": settings.sink, "window": settings.window, "positions": "global"},
        proposer={"arms": list(settings.arms)},
        seed=settings.seed,
        started=started,
        extra={
            "settings": settings.to_dict(),
            "temperature": settings.temperature,
            "prompt_sets": list(settings.prompt_sets),
            "cost_aware": settings.cost_aware,
            "pad_blocks": settings.pad_blocks,
            "conversations": settings.conversations,
            "turns": settings.turns,
            "max_new_tokens": settings.max_new_tokens,
            "assisted_draft": settings.assisted_draft,
            "draft_dtype": draft_dtype,
            "linear": settings.linear,
            "plain_kernels": list(settings.plain_kernels),
            "plain_kernel": {domain: run.plain_kernel for domain, run in table.runs.items()},
            "draft_linear": settings.draft_linear or settings.linear,
            "draft_window": settings.draft_window or settings.window,
        },
    )
    long = long_table(table)
    headline = {
        f"{r.domain}.{r.arm}": {"speedup": r.speedup, "tau": r.tau} for r in long.itertuples()
    }
    metrics = {
        **table_records(table),
        "wide": wide_table(long).to_dict(),
        "targets": targets_check(long, targets or {}).to_dict(orient="records"),
    }
    tables = {"table": long}
    for domain, run in table.runs.items():
        tables[f"turns_{domain}"] = run.turns.drop(columns=["reply_ids"])
        tables[f"steps_{domain}"] = run.steps
    return write_run(
        out, header, metrics, headline=headline, tables=tables, figures=dict(figures or {})
    )
