"""One command from a verifier to a named drafter: capture (or reuse) rollouts, train with
held-out evaluation, save the named artefact (``kakeya-lab align train``).

Every stage resumes: the capture folders resume their shards
(:func:`~kakeya_lab.align.rollouts.capture_rollouts`), training resumes from its checkpoint
under ``work_dir`` (:func:`~kakeya_lab.align.train.train_drafter`), and the named drafter
appears only when :func:`~kakeya_lab.proposers.drafters.named.save_named_drafter` renames a finished
folder into place, so an interrupted run leaves nothing under the name.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from kakeya_lab.align.pipeline import capture_domains, drafter_shapes, train_config_for
from kakeya_lab.align.rollouts import (
    CaptureOptions,
    capture_rollouts,
    draft_vocabulary,
    load_rollouts,
    read_manifest,
)
from kakeya_lab.align.train import RolloutData, TrainingResumeMismatch, train_drafter
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.data import domain_conversations
from kakeya_lab.proposers.drafters.named import check_name, drafters_home, save_named_drafter
from kakeya_lab.proposers.drafters.network import build_drafter, drafter_config_for
from kakeya_lab.results import now_iso
from kakeya_lab.session import model_eos_ids


@dataclass(frozen=True)
class AlignRecipe:
    """Settings of one ``align train`` run (defaults: a small chit-chat drafter)."""

    kind: str = "feature"
    steps: int = 300
    domain: str = "chitchat"
    train_conversations: int = 64
    dev_conversations: int = 8
    turns: int = 3  # user turns per conversation
    max_new_tokens: int = 48
    # teacher forcing at scale: further training conversations with their own replies
    # (after the first ``train_conversations``, which the verifier answers itself)
    teacher_conversations: int = 0
    teacher_turns: int = 16
    draft_vocab_size: int = 4096
    seed: int = 0
    batch_size: int = 16
    lr: float = 2e-3
    shape: dict[str, int | str] = field(default_factory=dict)  # drafter_shapes() overrides
    cache: SinkWindowConfig = field(default_factory=lambda: SinkWindowConfig(sink=4, window=252))

    def __post_init__(self):
        for name in ("steps", "train_conversations", "dev_conversations", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_new_tokens < 1 or self.draft_vocab_size < 1:
            raise ValueError("max_new_tokens and draft_vocab_size must be >= 1")
        if self.teacher_conversations < 0 or self.teacher_turns < 1:
            raise ValueError("teacher_conversations must be >= 0 and teacher_turns >= 1")


def training_record(history: pd.DataFrame, recipe: AlignRecipe, data: dict[str, Any]) -> dict:
    """The record stored with a named drafter: data, steps, the train loss (mean of the
    last tenth of the steps), the last held-out evaluation (loss, offline ``tau``,
    acceptance by draft position), and ``curve``: at every evaluation, the mean train loss
    since the previous one beside the held-out loss and ``tau`` (over-fitting shows there)."""
    train = history["train_total"].dropna()
    tail = train.iloc[-max(1, len(train) // 10) :]
    evals = history.dropna(subset=["offline_tau"])
    last = evals.iloc[-1] if len(evals) else None
    first = evals.iloc[0] if len(evals) else None

    def num(row, key: str) -> float | None:
        value = None if row is None else row.get(key)
        return None if value is None or math.isnan(value) else float(value)

    accept = sorted(c for c in history.columns if c.startswith("accept_at_"))
    curve, since = [], 0
    for row in evals.to_dict(orient="records"):  # train loss over each evaluation interval
        step = int(row["step"])
        span = history[(history["step"] > since) & (history["step"] <= step)]["train_total"]
        curve.append(
            {
                "step": step,
                "train_loss": float(span.mean()) if span.notna().any() else None,
                "held_out_loss": num(row, "eval_total"),
                "held_out_tau": num(row, "offline_tau"),
            }
        )
        since = step
    return {
        "data": data,
        "steps": recipe.steps,
        "recipe": {k: v for k, v in asdict(recipe).items() if k != "cache"},
        "train_loss": float(tail.mean()),
        "held_out_loss": num(last, "eval_total"),
        "held_out_tau": num(last, "offline_tau"),
        "held_out_tau_untrained": num(first, "offline_tau"),
        "held_out_accept_by_position": [num(last, c) for c in accept],
        "curve": curve,
        "finished": now_iso(),
    }


def capture_teacher_forced(
    loaded, recipe: AlignRecipe, root: Path, *, progress: bool = True
) -> Path:
    """Capture (or resume) ``root/<domain>-train-teacher``: ``recipe.teacher_conversations``
    training conversations after the first ``recipe.train_conversations``, each with up to
    ``recipe.teacher_turns`` of its own user/assistant turns, one prefill per conversation."""
    pool = domain_conversations(recipe.domain, "train")
    first = recipe.train_conversations
    if first + recipe.teacher_conversations > len(pool):
        raise ValueError(
            f"{recipe.domain} has {len(pool)} training conversations: {first} greedy plus "
            f"{recipe.teacher_conversations} teacher-forced do not fit; ask for fewer"
        )
    folder = Path(root) / f"{recipe.domain}-train-teacher"
    capture_rollouts(
        loaded,
        pool[first : first + recipe.teacher_conversations],
        folder,
        config=recipe.cache,
        split="train",
        options=CaptureOptions(
            turns_per_conversation=recipe.teacher_turns, replies="dataset", shard_size=64
        ),
        progress=progress,
    )
    return folder


def align_named_drafter(
    loaded,
    name: str,
    recipe: AlignRecipe = AlignRecipe(),
    *,
    work_dir: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> tuple[Path, dict]:
    """Capture (or resume/reuse) train and dev rollouts of ``recipe.domain`` under
    ``work_dir`` (default ``<drafters>/.work/<name>``), train a ``recipe.kind`` drafter
    with held-out evaluation, and save it as the named drafter ``name``.

    Returns the drafter's folder and its training record. Refuses an existing name
    unless ``overwrite`` (checked before any work). An interrupted run resumes its capture
    and training when run again with the same settings; once the drafter is saved the
    training checkpoint is removed and the capture kept, so a later run with other
    training settings reuses the capture.
    """
    check_name(name)
    if (drafters_home() / name).exists() and not overwrite:
        raise FileExistsError(
            f"a drafter named {name!r} exists in {drafters_home()}: choose another name "
            "or overwrite it (--overwrite)"
        )
    work = Path(work_dir) if work_dir is not None else drafters_home() / ".work" / name
    folders = capture_domains(
        loaded,
        [recipe.domain],
        work / "rollouts",
        config=recipe.cache,
        train_conversations=recipe.train_conversations,
        dev_conversations=recipe.dev_conversations,
        turns=recipe.turns,
        max_new_tokens=recipe.max_new_tokens,
        progress=progress,
    )
    train_folders = [folders[(recipe.domain, "train")]]
    if recipe.teacher_conversations:
        train_folders.append(
            capture_teacher_forced(loaded, recipe, work / "rollouts", progress=progress)
        )
    train_rows = load_rollouts(*train_folders)
    dev_rows = load_rollouts(folders[(recipe.domain, "dev")])
    vocab = draft_vocabulary(
        train_rows, recipe.draft_vocab_size, sorted(model_eos_ids(loaded.model))
    )
    shape = {**drafter_shapes()[recipe.kind], **recipe.shape}
    torch.manual_seed(recipe.seed)
    drafter = build_drafter(drafter_config_for(recipe.kind, loaded, vocab, **shape), loaded.model)
    context_len, block_size = int(shape["context_len"]), int(shape["block_size"])
    data = RolloutData(train_rows, context_len=context_len, block_size=block_size)
    held_out = RolloutData(dev_rows, context_len=context_len, block_size=block_size)
    cfg = train_config_for(
        recipe.kind, recipe.steps, seed=recipe.seed, batch_size=recipe.batch_size, lr=recipe.lr
    )
    t0 = time.perf_counter()
    try:
        history = train_drafter(
            drafter, data, cfg, work / "train", eval_data=held_out, progress=progress
        )
    except TrainingResumeMismatch as exc:
        raise TrainingResumeMismatch(
            f"{exc}. An interrupted `align train` resumes only with the same settings: run it "
            f"again with them, or remove {work / 'train'} to start training over"
        ) from None
    captured = [*train_folders, folders[(recipe.domain, "dev")]]
    described = {
        "domain": recipe.domain,
        "capture": {Path(f).name: str(f) for f in captured},
        "capture_stats": {Path(f).name: (read_manifest(f) or {}).get("stats") for f in captured},
        "options": asdict(
            CaptureOptions(
                turns_per_conversation=recipe.turns, max_new_tokens=recipe.max_new_tokens
            )
        )
        | {"cache": recipe.cache.to_dict()},
        "teacher_forced": {
            "conversations": recipe.teacher_conversations,
            "turns": recipe.teacher_turns,
        },
        "train": {k: data.fingerprint()[k] for k in ("conversations", "windows", "sha256")}
        | {"tokens": len(data.tokens)},
        "held_out": {k: held_out.fingerprint()[k] for k in ("conversations", "windows")}
        | {"tokens": len(held_out.tokens)},
    }
    record = training_record(history, recipe, described)
    # this run's share (a resumed run counts only its own part), and on how many threads
    record["train_seconds"] = round(time.perf_counter() - t0, 1)
    record["torch_threads"] = torch.get_num_threads()
    folder = save_named_drafter(
        name,
        drafter,
        verifier_name=loaded.description.name,
        training=record,
        overwrite=overwrite,
    )
    shutil.rmtree(work / "train", ignore_errors=True)  # saved; the capture stays for reuse
    return folder, record
