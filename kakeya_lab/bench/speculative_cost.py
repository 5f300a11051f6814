"""The cost model of one speculative benchmark run: this machine's verifier block cost
``v(n)`` measured in each run (before and after its arms; the median of each block size,
and the least-squares line ``fixed_s + per_token_s · n`` through them), each arm's
drafting cost, and the speedups the model predicts beside the measured ones.

Per speculative arm (``k`` its draft length, ``a`` its measured per-token acceptance
probability, ``d`` its proposer seconds per drafted token):

* ``draft_cost_ratio`` ``c = d / v(1)`` — Leviathan's ``c`` against the verifier's
  one-token block (the summary's ``draft_cost_ratio`` divides by plain decoding's
  measured seconds per token instead);
* ``predicted_speedup`` — :meth:`kakeya_lab.cost_model.CostModel.speedup`:
  ``E[tokens](a, k) / (v(k + 1) + k · d)`` over ``1 / v(1)``, the geometric acceptance
  model with the measured block cost;
* ``step_cost_speedup`` — the measured costs applied to the steps the arm actually took:
  ``tokens · v(1) / Σ_steps (v(proposed + 1) + proposer_s)``; it needs no acceptance
  model, so where it matches the measured speedup the block cost explains the timing
  and a gap to ``predicted_speedup`` is the acceptance model's.

Both predictions leave out what the block timings do not hold (sampling, bookkeeping,
the decoder's own Python), so they are read beside the measured ``speedup``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.cost_model import BlockCost, CostModel, fit_block_cost, measure_block_cost
from kakeya_lab.data import Conversation
from kakeya_lab.verifier import Verifier

ARM_COLUMNS = [
    "arm",
    "draft_length",
    "acceptance_probability",
    "draft_token_s",
    "draft_cost_ratio",
    "predicted_speedup",
    "step_cost_speedup",
    "speedup",
]


@dataclass(frozen=True)
class RunCostModel:
    """The block cost (medians and line), the timings it was made from, the context length
    they were measured after, and one row per speculative arm (columns
    :data:`ARM_COLUMNS`)."""

    block: BlockCost
    timings: dict[int, list[float]]
    context_tokens: int
    arms: pd.DataFrame

    def to_dict(self) -> dict:
        """JSON-ready: ``fixed_s``, ``per_token_s``, ``context_tokens``, ``timings``
        (block size → seconds) and ``arms`` (records)."""
        return {
            "fixed_s": self.block.fixed_s,
            "per_token_s": self.block.per_token_s,
            "context_tokens": self.context_tokens,
            "timings": {str(n): ts for n, ts in sorted(self.timings.items())},
            "arms": self.arms.astype(object)
            .where(self.arms.notna(), None)
            .to_dict(orient="records"),  # NaN -> null
        }

    def describe(self) -> str:
        """The cost model in a few lines (what the benchmark prints)."""
        medians = ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in self.block.measured)
        lines = [
            f"verifier block cost v(n), median ms by block size after {self.context_tokens} "
            f"context tokens: {medians}",
            f"  least-squares line: {self.block.fixed_s * 1e3:.2f} ms + "
            f"{self.block.per_token_s * 1e3:.2f} ms × n",
        ]
        for r in self.arms.itertuples():
            lines.append(
                f"  {r.arm}: c = {_fmt(r.draft_cost_ratio, '.4f')}, a = "
                f"{_fmt(r.acceptance_probability, '.3f')}, predicted "
                f"{_fmt(r.predicted_speedup, '.2f')}×, from its steps "
                f"{_fmt(r.step_cost_speedup, '.2f')}×, measured {_fmt(r.speedup, '.2f')}×"
            )
        return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None or pd.isna(value) else format(value, spec)


class BlockCostProbe:
    """Times this machine's verifier blocks of ``1..max_block`` tokens (at least 1..2)
    after the chat-templated turns of the first conversation, up to the cache's budget (a
    context like the run's). One untimed forward per size first (warm-up); every
    :meth:`measure` adds ``repeats`` timings per size to ``timings``, so a run can measure
    before and after its arms and fit both (machine drift then weighs on both ends)."""

    def __init__(
        self,
        loaded,
        config: SinkWindowConfig,
        conversations: Sequence[Conversation],
        max_block: int,
        *,
        system: str | None = None,
    ):
        limit = config.budget or 1024  # a full cache is the run's steady state; no longer
        context = ChatTemplate(loaded.tokenizer, system=system).replay(
            [conversations[0].turns], limit
        )
        self.context_tokens = len(context)
        self.verifier = Verifier(loaded.model, config)
        self.verifier.append(context)
        self.sizes = list(range(1, max(2, max_block) + 1))
        measure_block_cost(self.verifier, self.sizes, repeats=1)  # warm-up, not kept
        self.timings: dict[int, list[float]] = {n: [] for n in self.sizes}

    def measure(self, repeats: int = 5) -> dict[int, list[float]]:
        """Time ``repeats`` more forwards of every size; return all timings so far."""
        for n, ts in measure_block_cost(self.verifier, self.sizes, repeats=repeats).items():
            self.timings[n].extend(ts)
        return self.timings


def arm_costs(block: BlockCost, summary: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One row per speculative arm of ``summary`` (see the module docstring); ``steps``
    are the run's verifier steps (``arm``, ``proposed``, ``emitted``, ``proposer_s``)."""
    rows = []
    for r in summary[summary["arm"] != "plain"].itertuples():
        s = steps[steps["arm"] == r.arm]
        proposed = int(s["proposed"].sum())
        draft_token_s = float(s["proposer_s"].sum()) / proposed if proposed else None
        a = r.acceptance_probability
        predicted = None
        if draft_token_s is not None and a is not None and not pd.isna(a):
            predicted = CostModel(block, draft_token_s).speedup(float(a), int(r.draft_length))
        step_cost = None
        if len(s):
            spent = sum(block(int(p) + 1) for p in s["proposed"]) + float(s["proposer_s"].sum())
            step_cost = int(s["emitted"].sum()) * block(1) / spent
        rows.append(
            {
                "arm": r.arm,
                "draft_length": int(r.draft_length),
                "acceptance_probability": a,
                "draft_token_s": draft_token_s,
                "draft_cost_ratio": draft_token_s / block(1) if draft_token_s is not None else None,
                "predicted_speedup": predicted,
                "step_cost_speedup": step_cost,
                "speedup": r.speedup,
            }
        )
    return pd.DataFrame(rows, columns=ARM_COLUMNS)


def run_cost_model(
    timings: dict[int, list[float]],
    context_tokens: int,
    summary: pd.DataFrame,
    steps: pd.DataFrame,
) -> RunCostModel:
    """Fit ``timings`` and derive every arm's costs and predicted speedups."""
    block = fit_block_cost(timings)
    return RunCostModel(block, timings, context_tokens, arm_costs(block, summary, steps))
