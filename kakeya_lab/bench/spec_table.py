"""The Spec-Bench-style table: every method on every held-out domain, one run per domain.

:func:`run_spec_table` runs :func:`~kakeya_lab.bench.speculative.run_speculative` once per
prompt set (``code-dev``, ``prose-dev``, ``chitchat-dev``...) with the same arms, each arm
against plain decoding of the same model, cache and turns in that run, and, when a draft
model is named, transformers' own assisted generation on that domain's first prompts.

:func:`long_table` gives one row per domain and arm (speedup, tau, tokens/s, acceptance by
draft position, zero-accept rate, whether the arm emitted the plain stream on every turn,
and the speedups the run's cost model predicts: from a geometric acceptance model for
chains, and from the steps the arm actually took for every arm); :func:`wide_table` the results page's view, methods down
and domains across. Arms are ``SPEC@K`` keys (``ngram@8``, ``drafter-tree:NAME@8``): one
method, one draft length or node budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pandas as pd
from tqdm.auto import tqdm

from kakeya_lab.bench.speculative import (
    AssistedGeneration,
    SpeculativeRun,
    arm_lossless,
    hf_assisted_generation,
    run_speculative,
)
from kakeya_lab.bench.speculative_settings import SpecTableSettings
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.proposers import Proposer

TABLE_COLUMNS = [
    "domain",
    "arm",
    "proposer",
    "draft_length",
    "speedup",
    "tau",
    "tokens_per_s",
    "acceptance_rate",
    "zero_accept_rate",
    "acceptance_by_position",
    "predicted_speedup",
    "step_cost_speedup",
    "lossless",
    "generated_tokens",
    "plain_kernel",
]


@dataclass
class SpecTable:
    """One :class:`SpeculativeRun` per domain, and transformers' assisted generation per
    domain when it was timed."""

    runs: dict[str, SpeculativeRun]
    assisted: dict[str, AssistedGeneration] = field(default_factory=dict)
    temperature: float = 0.0  # sampling streams differ from plain by design


def run_spec_table(
    loaded,
    settings: SpecTableSettings,
    make: Callable[[str], Callable[[], Proposer]],
    *,
    assisted_draft=None,
    progress: bool = True,
) -> SpecTable:
    """Run ``settings.arms`` (``SPEC@K`` keys) on every prompt set of ``settings``;
    ``make(spec)`` gives a fresh proposer factory for a spec without its ``@K``. With
    ``settings.temperature`` > 0 every arm samples (rejection sampling), seeded per turn
    from ``settings.seed``. ``assisted_draft`` (the loaded ``settings.assisted_draft``)
    also times transformers' assisted generation on each domain's first prompts."""
    table = SpecTable(runs={}, temperature=settings.temperature)
    for prompt_set in tqdm(
        settings.prompt_sets, desc="domains", unit="domain", disable=not progress
    ):
        run_settings = settings.speculative(prompt_set)
        convs = run_settings.conversation_list()
        factories = {arm: make(arm.rpartition("@")[0]) for arm in settings.arms}
        domain = prompt_set.rpartition("-")[0]
        table.runs[domain] = run_speculative(loaded, factories, convs, run_settings, progress=False)
        if assisted_draft is not None:
            prompts = [ChatTemplate(loaded.tokenizer).user(c.turns[0]) for c in convs]
            table.assisted[domain] = hf_assisted_generation(
                loaded.model,
                getattr(assisted_draft, "model", assisted_draft),
                prompts,
                max_new_tokens=settings.max_new_tokens,
            )
    return table


def long_table(table: SpecTable) -> pd.DataFrame:
    """One row per domain and arm (columns :data:`TABLE_COLUMNS`), plus an
    ``hf-assisted`` row per domain where transformers' assisted generation was timed
    (its speedup is against transformers' own plain ``generate``)."""
    rows = []
    for domain, run in table.runs.items():
        lossless = arm_lossless(run.turns) if table.temperature == 0.0 else {}
        cost = run.cost.arms.set_index("arm") if run.cost is not None else pd.DataFrame()
        for r in run.summary.to_dict(orient="records"):
            row = {k: r.get(k) for k in TABLE_COLUMNS if k in r}
            for key in ("predicted_speedup", "step_cost_speedup"):
                value = cost[key].get(r["arm"]) if key in cost else None
                row[key] = None if value is None or pd.isna(value) else float(value)
            rows.append(
                {
                    **row,
                    "domain": domain,
                    "lossless": lossless.get(r["arm"]),
                    "plain_kernel": run.plain_kernel,  # the baseline of this row's speedup
                }
            )
        hf = table.assisted.get(domain)
        if hf is not None:
            rows.append(
                {
                    "domain": domain,
                    "arm": "hf-assisted",
                    "proposer": "transformers assisted generation",
                    "speedup": hf.speedup,
                    "tokens_per_s": hf.assisted_tokens_per_s,
                    "lossless": hf.identical_output if table.temperature == 0.0 else None,
                }
            )
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def _is_plain(arm: str) -> bool:
    """``plain`` or ``plain[KERNEL]``: plain decoding, not a method."""
    return arm == "plain" or str(arm).startswith("plain[")


def wide_table(long: pd.DataFrame) -> pd.DataFrame:
    """Methods down, domains across: ``speedup× (τ tau)``; plain decoding as tokens/s, the
    ``plain`` row (every speedup's baseline: the fastest plain decoding of the domain's run)
    naming its kernel, ``plain[KERNEL]`` rows (the other kernels) first after it."""

    def cell(r) -> str:
        if _is_plain(r["arm"]):
            kernel = r.get("plain_kernel")
            named = f" ({kernel})" if r["arm"] == "plain" and isinstance(kernel, str) else ""
            return f"{r['tokens_per_s']:.1f} tok/s{named}"
        tau = "" if pd.isna(r["tau"]) else f" (τ {r['tau']:.2f})"
        return f"{r['speedup']:.2f}×{tau}"

    out = long.assign(cell=long.apply(cell, axis=1))
    wide = out.pivot(index="arm", columns="domain", values="cell")
    arms = list(dict.fromkeys(long["arm"]))
    order = [a for a in arms if _is_plain(a)] + [a for a in arms if not _is_plain(a)]
    return wide.reindex(index=order, columns=list(dict.fromkeys(long["domain"]))).fillna("-")


def cost_models(table: SpecTable) -> pd.DataFrame:
    """Each domain run's verifier block cost: the median of each block size (``median_ms``,
    size → ms) and the least-squares line ``v(n) = fixed + per_token · n``."""
    return pd.DataFrame(
        [
            {
                "domain": d,
                "median_ms": {n: round(t * 1e3, 2) for n, t in run.cost.block.measured},
                "fixed_ms": run.cost.block.fixed_s * 1e3,
                "per_token_ms": run.cost.block.per_token_s * 1e3,
                "context_tokens": run.cost.context_tokens,
            }
            for d, run in table.runs.items()
            if run.cost is not None
        ]
    )


def table_records(table: SpecTable) -> dict:
    """JSON-ready record of the whole table (per-domain summaries, cost models, HF runs)."""
    long = long_table(table)
    return {
        "rows": long.astype(object).where(long.notna(), None).to_dict(orient="records"),
        "cost_models": {d: r.cost.to_dict() for d, r in table.runs.items() if r.cost is not None},
        "assisted": {d: hf.to_dict() for d, hf in table.assisted.items()},
        "block_padding": {
            d: {str(n): m for n, m in r.block_padding.items()}
            for d, r in table.runs.items()
            if r.block_padding is not None
        },
    }


def targets_check(long: pd.DataFrame, targets: Mapping[str, float]) -> pd.DataFrame:
    """Per domain with a target: the best lossless method's speedup (plain decoding on any
    kernel and transformers' assisted generation are not methods here), the target, and
    whether it is met."""
    rows = []
    for domain, target in targets.items():
        method = ~long["arm"].map(_is_plain) & (long["arm"] != "hf-assisted")
        arms = long[(long["domain"] == domain) & method]
        arms = arms[arms["lossless"].fillna(True).astype(bool)]  # None: sampled
        if arms.empty:
            continue
        best = arms.sort_values("speedup").iloc[-1]
        rows.append(
            {
                "domain": domain,
                "best_arm": best["arm"],
                "speedup": best["speedup"],
                "target": target,
                "met": bool(best["speedup"] >= target),
            }
        )
    return pd.DataFrame(rows)


def results_table(long: pd.DataFrame, csv_name: str = "table.csv") -> tuple[str, list[dict]]:
    """The markdown table of docs/results.md (methods down, domains across) and its evidence claims:
    each cell quotes ``DOMAIN SPEEDUP× (τ TAU)`` (plain: ``DOMAIN TOKENS/S tok/s``), checked
    against row ``i`` of ``csv_name`` (this long table as CSV) by ``kakeya-lab evidence
    check``."""
    domains = list(dict.fromkeys(long["domain"]))
    arms = list(dict.fromkeys(long["arm"]))
    cells: dict[tuple[str, str], str] = {}
    claims: list[dict] = []
    for i, r in enumerate(long.to_dict(orient="records")):
        d = r["domain"]
        if r["arm"] == "plain":
            text = f"{d} {r['tokens_per_s']:.1f} tok/s"
            claims.append({"quote": text, "file": csv_name, "key": f"{i}.tokens_per_s"})
        elif pd.isna(r["tau"]):
            text = f"{d} {r['speedup']:.2f}×"
            claims.append({"quote": text, "file": csv_name, "key": f"{i}.speedup"})
        else:
            text = f"{d} {r['speedup']:.2f}× (τ {r['tau']:.2f})"
            claims.append({"quote": text, "file": csv_name, "key": f"{i}.speedup", "index": 0})
            claims.append({"quote": text, "file": csv_name, "key": f"{i}.tau", "index": 1})
        cells[(r["arm"], d)] = text
    lines = [
        "| arm | " + " | ".join(domains) + " |",
        "|---|" + "---|" * len(domains),
    ]
    for arm in arms:
        lines.append(f"| {arm} | " + " | ".join(cells.get((arm, d), "-") for d in domains) + " |")
    return "\n".join(lines), claims
