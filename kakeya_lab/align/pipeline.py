"""The proposer-alignment pipeline as the notebook runs it: capture, train, choose, record.

* :func:`per_domain` — a setting given as one value or as a ``{domain: value}`` dict;
* :func:`drafter_shapes` — the shape of each drafter kind from a few knobs (shared by the
  notebook and ``tests/test_align.py``);
* :func:`train_config_for` — the training rules per kind (LoRA: smaller batches, a quarter
  of the learning rate);
* :func:`capture_domains` — train and dev rollouts of every domain, one folder each;
* :func:`train_drafters` — one seeded training run per kind;
* :func:`offline_before_after` — held-out offline acceptance at the first and last evaluation;
* :func:`best_drafter` — the trained kind with the highest held-out ``tau`` in a domain;
* :func:`alignment_headline` and :func:`write_alignment_results` — the run folder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pandas as pd
import torch

from kakeya_lab.align.rollouts import CaptureOptions, capture_rollouts
from kakeya_lab.align.train import RolloutData, TrainConfig, train_drafter
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.data import Split, domain_conversations
from kakeya_lab.proposers.drafters.checkpoint import save_drafter
from kakeya_lab.proposers.drafters.network import build_drafter, drafter_config_for

if TYPE_CHECKING:
    from kakeya_lab.align.settings import AlignmentSettings
    from kakeya_lab.proposers.drafters.network import AnyDrafter

T = TypeVar("T")


def per_domain(value: T | Mapping[str, T], domains: Sequence[str]) -> dict[str, T]:
    """``value`` for every domain: a dict is looked up (every domain must be present),
    anything else applies to all."""
    if isinstance(value, Mapping):
        missing = [d for d in domains if d not in value]
        if missing:
            raise ValueError(f"no setting for domain(s) {missing}: give every domain a value")
        return {d: value[d] for d in domains}
    return dict.fromkeys(domains, value)


def drafter_shapes(
    context_len: int = 8,
    block_size: int = 4,
    block_width: int = 256,
    lora_base: str = "early-exit:8",
    lora_rank: int = 8,
) -> dict[str, dict]:
    """Shape overrides per drafter kind (passed to :func:`drafter_config_for`). The LoRA
    drafter reads three times the context (it sees tokens, not features)."""
    return {
        "feature": dict(context_len=context_len, block_size=block_size),
        "block": dict(
            context_len=context_len,
            block_size=block_size,
            width=block_width,
            num_heads=4,
            num_layers=2,
        ),
        "lora": dict(
            context_len=3 * context_len, block_size=block_size, base=lora_base, lora_rank=lora_rank
        ),
    }


def train_config_for(
    kind: str, steps: int, *, seed: int = 0, batch_size: int = 16, lr: float = 2e-3
) -> TrainConfig:
    """Training settings of one kind: evaluation five times and a checkpoint twice per run,
    warmup over a fifth of the steps (at most 20); LoRA with batches of 4 at ``lr / 4``."""
    lora = kind == "lora"
    return TrainConfig(
        steps=steps,
        seed=seed,
        batch_size=4 if lora else batch_size,
        lr=lr / 4 if lora else lr,
        eval_every=max(1, steps // 5),
        checkpoint_every=max(1, steps // 2),
        warmup_steps=min(20, steps // 5 + 1),
    )


def capture_domains(
    loaded,
    domains: Sequence[str],
    root: Path,
    *,
    config: SinkWindowConfig,
    train_conversations: int | Mapping[str, int],
    dev_conversations: int | Mapping[str, int],
    turns: int | Mapping[str, int],
    max_new_tokens: int,
    progress: bool = False,
) -> dict[tuple[str, str], Path]:
    """Capture (or resume) ``root/<domain>-<split>`` for every domain and both splits."""
    n_train = per_domain(train_conversations, domains)
    n_dev = per_domain(dev_conversations, domains)
    n_turns = per_domain(turns, domains)
    folders: dict[tuple[str, str], Path] = {}
    for domain in domains:
        options = CaptureOptions(
            turns_per_conversation=n_turns[domain], max_new_tokens=max_new_tokens
        )
        splits: tuple[tuple[Split, int], ...] = (("train", n_train[domain]), ("dev", n_dev[domain]))
        for split, n in splits:
            folder = Path(root) / f"{domain}-{split}"
            capture_rollouts(
                loaded,
                domain_conversations(domain, split, limit=n),
                folder,
                config=config,
                split=split,
                options=options,
                progress=progress,
            )
            folders[(domain, split)] = folder
    return folders


def train_drafters(
    loaded,
    kinds: Sequence[str],
    vocab: Sequence[int],
    shapes: Mapping[str, dict],
    train_rows,
    dev_rows,
    *,
    steps: Mapping[str, int],
    out_dir: Path,
    seed: int = 0,
    batch_size: int = 16,
    lr: float = 2e-3,
    progress: bool = False,
) -> tuple[dict[str, AnyDrafter], dict[str, pd.DataFrame]]:
    """Build and train one drafter per kind (each from ``torch.manual_seed(seed)``), with
    held-out evaluation on ``dev_rows``; returns the drafters and their histories."""
    trained, histories = {}, {}
    for kind in kinds:
        torch.manual_seed(seed)
        shape = shapes[kind]
        drafter = build_drafter(drafter_config_for(kind, loaded, vocab, **shape), loaded.model)
        data = RolloutData(
            train_rows, context_len=shape["context_len"], block_size=shape["block_size"]
        )
        held_out = RolloutData(
            dev_rows, context_len=shape["context_len"], block_size=shape["block_size"]
        )
        cfg = train_config_for(kind, steps[kind], seed=seed, batch_size=batch_size, lr=lr)
        histories[kind] = train_drafter(
            drafter, data, cfg, Path(out_dir) / kind, eval_data=held_out, progress=progress
        )
        trained[kind] = drafter
    return trained, histories


def offline_before_after(histories: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Held-out losses and offline acceptance at the first and the last evaluation, per kind."""
    rows = []
    for kind, history in histories.items():
        evals = history.dropna(subset=["offline_tau"])
        for when, row in (("before", evals.iloc[0]), ("after", evals.iloc[-1])):
            rows.append(
                {
                    "drafter": kind,
                    "when": when,
                    **{
                        column: row[column]
                        for column in history.columns
                        if column.startswith(("accept_at", "offline_tau", "eval_"))
                    },
                }
            )
    return pd.DataFrame(rows)


def best_drafter(
    summary: pd.DataFrame, domain: str, kinds: Sequence[str], split: str = "dev"
) -> str:
    """The kind among ``kinds`` with the highest ``tau`` on ``domain``/``split``."""
    rows = summary[
        (summary["domain"] == domain)
        & (summary["split"] == split)
        & summary["proposer"].isin(list(kinds))
    ]
    if rows.empty:
        raise ValueError(f"no rows for {list(kinds)} on {domain}/{split}")
    return str(rows.sort_values("tau", ascending=False)["proposer"].iloc[0])


def alignment_headline(summary: pd.DataFrame, curve: pd.DataFrame, best: str) -> dict:
    """Headline figures: the best drafter's fastest draft length, and held-out tau and
    speedup per domain and arm."""
    best_row = curve[curve["arm"] != "plain"].sort_values("speedup").iloc[-1]
    dev = summary[summary["split"] == "dev"]
    return {
        "best_drafter": best,
        "best_draft_length": int(best_row["draft_length"]),
        "tau": best_row["tau"],
        "speedup": best_row["speedup"],
        "lossless": bool(summary["lossless"].all()),
        **{f"{r.domain}.{r.arm}.tau": r.tau for r in dev.itertuples()},
        **{f"{r.domain}.{r.arm}.speedup": r.speedup for r in dev.itertuples() if r.arm != "plain"},
    }


def write_alignment_results(
    run_dir: Path,
    work: Path,
    settings: AlignmentSettings,
    model,
    *,
    rollouts: Path,
    trained: Mapping[str, AnyDrafter],
    histories: Mapping[str, pd.DataFrame],
    summary: pd.DataFrame,
    curve: pd.DataFrame,
    offline: pd.DataFrame,
    best: str,
    figures: Mapping,
    experiment: str = "alignment",
    run_id: str | None = None,
    started: str | None = None,
) -> list[str]:
    """Drafters, metrics, tables and figures into the run folder; the names written.
    ``model``: ``loaded.description``; ``rollouts``: the capture folder the header names."""
    from kakeya_lab.results import run_header, write_run

    header = run_header(
        experiment=experiment,
        run_id=run_id or Path(run_dir).resolve().name,
        model=model,
        cache={"sink": settings.sink, "window": settings.window, "positions": "global"},
        proposer={
            "drafters": list(settings.drafters),
            "eval_draft_length": settings.eval_draft_length,
            "draft_lengths": list(settings.draft_lengths),
        },
        seed=settings.seed,
        started=started,
        extra={
            "settings": settings.to_dict(),
            "rollouts": str(rollouts),
            **settings.header_fields(),
        },
    )
    work = Path(work)
    for kind, drafter in trained.items():
        save_drafter(drafter, work / "drafters" / kind)
    write_run(
        run_dir,
        header,
        {
            "by_domain": summary.to_dict(orient="records"),
            "speedup_vs_draft_length": curve.to_dict(orient="records"),
            "offline": offline.to_dict(orient="records"),
        },
        headline=alignment_headline(summary, curve, best),
        figures=dict(figures),
    )
    summary.to_csv(work / "by_domain.csv", index=False)
    for kind, history in histories.items():
        history.to_csv(work / f"history_{kind}.csv", index=False)
    return sorted(p.name for p in Path(run_dir).iterdir())
