"""Held-out evaluation of drafters by domain: the speculative benchmark per (domain, split).

For each domain (chit-chat, code, prose) and split (``dev``: held out, never captured or
trained on; ``train``: the first conversations of the training split, i.e. in-domain
prompts the drafter saw) every proposer runs beside plain decoding of the same verifier
and cache in one process (:func:`kakeya_lab.bench.speculative.run_speculative`), so
acceptance, ``tau`` and speedup are measured side by side. Splits are by conversation
(chit-chat), by source file (code) and by passage (prose); see :mod:`kakeya_lab.data`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pandas as pd

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.data import DOMAINS, Split, domain_conversations
from kakeya_lab.proposers import DraftModelProposer, Proposer
from kakeya_lab.proposers.drafters.proposer import DrafterProposer


def drafter_factory(
    drafter, config: SinkWindowConfig, label: str | None = None
) -> Callable[[], Proposer]:
    """A proposer factory for a drafter of any kind (LoRA drafters draft with their own cache)."""
    if drafter.config.kind == "lora":
        model = drafter.draft_model()
        return lambda: DraftModelProposer(model, config, label=label or "lora")
    return lambda: DrafterProposer(drafter, label=label)


def evaluate_by_domain(
    loaded,
    proposers: Mapping[str, Callable[[], Proposer]],
    draft_lengths: Sequence[int],
    *,
    config: SinkWindowConfig,
    domains: Sequence[str] = DOMAINS,
    splits: Sequence[Split] = ("dev", "train"),
    conversations: int = 4,
    turns: int = 2,
    max_new_tokens: int = 48,
    plain_kernels: Sequence[str] = (),
    progress: bool = True,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Summary rows (one per domain × split × arm) and step rows, each tagged with
    ``domain`` and ``split``; ``lossless`` says whether every greedy arm emitted exactly
    the plain stream on that domain and split. Plain decoding is also timed on each of
    ``plain_kernels`` (full-precision kernels, torch): the fastest is ``plain`` and every
    speedup's baseline, the others ``plain[KERNEL]`` rows, and ``plain_kernel`` names it.
    No block-cost probe runs (the summary's speedups are measured; its
    ``expected_speedup`` needs no probe)."""
    settings = SpeculativeSettings.for_cache(
        config,
        draft_lengths=tuple(draft_lengths),
        turns=turns,
        max_new_tokens=max_new_tokens,
        measure_cost=False,
        plain_kernels=tuple(plain_kernels),
    )
    summaries, steps = [], []
    for domain in domains:
        for split in splits:
            convs = domain_conversations(domain, split, limit=conversations)
            if not convs:
                raise ValueError(f"no {split} conversations for domain {domain!r}")
            run = run_speculative(loaded, proposers, convs, settings, progress=progress)
            summary = run.summary.assign(
                domain=domain,
                split=split,
                lossless=greedy_streams_identical(run.turns),
                plain_kernel=run.plain_kernel,
            )
            summaries.append(summary)
            steps.append(run.steps.assign(domain=domain, split=split))
    return pd.concat(summaries, ignore_index=True), pd.concat(steps, ignore_index=True)
