"""Train a drafter on verifier rollouts: AdamW, warmup + cosine, gradient clipping, seeded.

Batches are windows of ``context_len + block_size + 1`` consecutive positions of one
rollout (see :meth:`Drafter.predict`). Step ``i`` draws its windows from a generator
seeded by ``(seed, i)``, so a run resumed from a checkpoint continues exactly as the
uninterrupted run would. ``out_dir/checkpoint`` holds the latest training state
(drafter + optimizer as safetensors, ``trainer.json``); ``out_dir/drafter`` the final
drafter. Periodic evaluation reports losses and the *offline acceptance* on held-out
windows: for greedy drafting, how many leading draft tokens equal the verifier's.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kakeya_lab.align.losses import LossWeights, distill_losses
from kakeya_lab.proposers.drafters.checkpoint import (
    CONFIG,
    WEIGHTS,
    CheckpointError,
    drafter_config,
    load_trainable,
    read_json,
    read_tensors,
    save_drafter,
    write_folder_atomic,
)
from kakeya_lab.proposers.drafters.network import trainable_state
from kakeya_lab.resume import ResumeMismatch, check_resume

if TYPE_CHECKING:
    from kakeya_lab.proposers.drafters.network import AnyDrafter

TRAINER = "trainer.json"
OPTIMIZER = "optimizer.safetensors"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    loss: LossWeights = field(default_factory=LossWeights)
    train_on: str = "generated"  # "generated": only positions predicting verifier output
    eval_every: int = 50
    eval_windows: int = 256
    checkpoint_every: int = 100

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if self.train_on not in ("generated", "all"):
            raise ValueError(f"train_on must be 'generated' or 'all', got {self.train_on!r}")
        if not self.lr > 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be > 0")

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine down to ``min_lr_ratio * lr`` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> TrainConfig:
        raw = dict(raw)
        raw["loss"] = LossWeights(**raw.get("loss", {}))
        return cls(**raw)


class RolloutData:
    """Rollout rows flattened into tensors, with the window starts a drafter can train on."""

    def __init__(self, dataset, *, context_len: int, block_size: int, train_on: str = "generated"):
        rows = list(dataset)
        if not rows:
            raise ValueError("no rollout rows")
        self.window = context_len + block_size + 1
        self.context_len, self.block_size = context_len, block_size

        def cat(key: str) -> np.ndarray:
            return np.concatenate([np.asarray(r[key]) for r in rows])

        self.tokens = torch.from_numpy(cat("token_ids").astype(np.int64))
        self.hidden = torch.from_numpy(cat("hidden"))  # float16
        self.topk_ids = torch.from_numpy(cat("topk_ids").astype(np.int64))
        self.topk_logits = torch.from_numpy(cat("topk_logits").astype(np.float32))
        generated = torch.from_numpy(cat("generated"))
        mask = torch.from_numpy(cat("loss_mask"))
        # the prediction at i is of token i+1: train where that token is the verifier's
        nxt = torch.zeros_like(generated)
        nxt[:-1] = generated[1:]
        self.mask = mask & nxt if train_on == "generated" else mask.clone()
        starts, offset = [], 0
        for r in rows:
            T = len(r["token_ids"])
            s = np.arange(offset, offset + T - self.window + 1)
            # keep windows whose first drafted token (at p + 1) is a trained position
            if len(s):
                s = s[self.mask[s + context_len].numpy()]
            starts.append(s)
            offset += T
        self.starts = torch.from_numpy(np.concatenate(starts).astype(np.int64))
        self.domains = sorted({str(r["domain"]) for r in rows})
        self.conversations = len(rows)
        if len(self.starts) == 0:
            raise ValueError(
                f"no training windows: rollouts too short for {self.window} positions "
                f"(context_len {context_len} + block_size {block_size} + 1)"
            )

    def __len__(self) -> int:
        return len(self.starts)

    def fingerprint(self) -> dict:
        """What identifies this training data for a strict resume: window shape, domains,
        sizes and a sha256 over the tokens, training mask and window starts."""
        digest = hashlib.sha256()
        for tensor in (self.tokens, self.mask, self.starts):
            digest.update(tensor.numpy().tobytes())
        return {
            "context_len": self.context_len,
            "block_size": self.block_size,
            "domains": self.domains,
            "conversations": self.conversations,
            "windows": len(self.starts),
            "sha256": digest.hexdigest(),
        }

    def batch(self, starts: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.window)
        return {
            "tokens": self.tokens[idx],
            "features": self.hidden[idx].float(),
            "topk_ids": self.topk_ids[idx],
            "topk_logits": self.topk_logits[idx],
            "mask": self.mask[idx],
        }

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        pick = torch.randint(len(self.starts), (n,), generator=generator)
        return self.batch(self.starts[pick])

    def fixed(self, n: int, seed: int = 1234) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        pick = torch.randperm(len(self.starts), generator=g)[:n]
        return self.batch(self.starts[pick])


def step_losses(
    drafter: AnyDrafter, batch: dict, draft_length: int, weights: LossWeights
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Losses of one batch, plus the predicted logits and the window offsets they cover."""
    pred, offsets = drafter.predict(batch["features"], batch["tokens"], draft_length)
    logits = drafter.logits(pred)
    index = drafter.draft_index
    losses = distill_losses(
        logits,
        pred,
        batch["features"][:, offsets],
        index[batch["topk_ids"][:, offsets]],
        batch["topk_logits"][:, offsets],
        index[batch["topk_ids"][:, offsets, 0]],  # the verifier's own next token
        batch["mask"][:, offsets],
        weights,
    )
    return losses, logits, offsets


@torch.no_grad()
def evaluate_offline(
    drafter: AnyDrafter, batch: dict, draft_length: int, weights: LossWeights
) -> dict:
    """Held-out losses and greedy offline acceptance of the block drafted at ``p``.

    ``accept_at_i``: share of windows whose first ``i + 1`` draft tokens all equal the
    verifier's; ``offline_tau`` = 1 + expected accepted drafts (what a greedy verifier step
    would emit with ``draft_length`` of these drafts).
    """
    was = drafter.training
    drafter.eval()
    losses, logits, offsets = step_losses(drafter, batch, draft_length, weights)
    drafter.train(was)
    n = drafter.config.context_len
    block = (offsets >= n).nonzero().flatten()  # offsets p .. p+draft_length-1
    chosen = drafter.draft_ids[logits[:, block].argmax(-1)]
    truth = batch["topk_ids"][:, offsets[block], 0]  # what the greedy verifier emits
    prefix_ok = (chosen == truth).long().cumprod(dim=1).float()
    out = {f"eval_{name}": float(v) for name, v in losses.items()}
    for i in range(prefix_ok.shape[1]):
        out[f"accept_at_{i}"] = float(prefix_ok[:, i].mean())
    out["offline_tau"] = 1.0 + float(prefix_ok.sum(1).mean())
    return out


class TrainingResumeMismatch(CheckpointError, ResumeMismatch):
    """A training checkpoint made with another drafter, training config or data."""


def training_settings(
    drafter: AnyDrafter, cfg: TrainConfig, data: RolloutData, eval_data: RolloutData | None
) -> dict:
    """Everything a resumed training run must share with the run it continues."""
    return json.loads(
        json.dumps(
            {
                "drafter": drafter.config.to_dict(),
                "train": cfg.to_dict(),
                "data": data.fingerprint(),
                "eval_data": eval_data.fingerprint() if eval_data is not None else None,
            }
        )
    )


def _save_checkpoint(
    folder: Path,
    drafter: AnyDrafter,
    optimizer,
    step: int,
    cfg: TrainConfig,
    history,
    settings: dict,
) -> None:
    opt = optimizer.state_dict()
    tensors = {}
    for pid, state in opt["state"].items():
        for name, value in state.items():
            tensors[f"{pid}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    write_folder_atomic(
        folder,
        {
            WEIGHTS: trainable_state(drafter),
            CONFIG: drafter.config.to_dict(),
            OPTIMIZER: tensors,
            TRAINER: {
                "step": step,
                "train": cfg.to_dict(),
                "param_groups": opt["param_groups"],
                "history": history,
                "settings": settings,
            },
        },
    )


def _load_checkpoint(
    folder: Path, drafter: AnyDrafter, optimizer, settings: dict
) -> tuple[int, list]:
    meta = read_json(folder / TRAINER, "training checkpoint")
    if drafter_config(folder).to_dict() != drafter.config.to_dict():
        raise TrainingResumeMismatch(
            f"{folder} holds a drafter of another shape or verifier; use a new out_dir or resume=False"
        )
    try:
        check_resume(meta.get("settings"), settings, str(folder))
    except ResumeMismatch as exc:
        raise TrainingResumeMismatch(f"{exc} (train_drafter: resume=False starts over)") from None
    load_trainable(drafter, read_tensors(folder / WEIGHTS), str(folder / WEIGHTS))
    state: dict = {}
    for key, value in read_tensors(folder / OPTIMIZER).items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return int(meta["step"]), list(meta["history"])


def train_drafter(
    drafter: AnyDrafter,
    data: RolloutData,
    cfg: TrainConfig,
    out_dir: str | Path | None = None,
    *,
    eval_data: RolloutData | None = None,
    resume: bool = True,
    stop_after: int | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Train ``drafter`` in place; return one history row per logged step.

    With ``out_dir``, checkpoints every ``checkpoint_every`` steps and at the end, and
    resumes from ``out_dir/checkpoint`` when ``resume`` — only if the drafter, the
    TrainConfig and the training and evaluation data are the ones it was made with (else
    :class:`TrainingResumeMismatch` names the difference); ``resume=False`` starts over. ``stop_after`` ends the run after
    that many steps (as an interruption would), leaving a checkpoint to resume from.
    """
    draft_length = drafter.config.block_size
    if data.context_len != drafter.config.context_len or data.block_size != draft_length:
        raise ValueError("the rollout windows do not match the drafter's context_len/block_size")
    params = [p for p in drafter.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    ckpt = Path(out_dir) / "checkpoint" if out_dir is not None else None
    step = 0
    history: list[dict] = []
    settings = training_settings(drafter, cfg, data, eval_data)
    if ckpt is not None and resume and ckpt.exists():
        step, history = _load_checkpoint(ckpt, drafter, optimizer, settings)
    eval_batch = eval_data.fixed(cfg.eval_windows) if eval_data is not None else None
    end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
    if step == 0 and eval_batch is not None:
        history.append({"step": 0, **evaluate_offline(drafter, eval_batch, draft_length, cfg.loss)})
    drafter.train()
    bar = tqdm(
        total=cfg.steps,
        initial=step,
        desc=f"train {drafter.config.kind}",
        unit="step",
        disable=not progress,
    )
    t0 = time.perf_counter()
    while step < end:
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(step)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        losses, _, _ = step_losses(drafter, data.sample(cfg.batch_size, g), draft_length, cfg.loss)
        optimizer.zero_grad(set_to_none=True)
        losses["total"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        row = {
            "step": step,
            "lr": cfg.lr_at(step - 1),
            "grad_norm": float(grad_norm),
            **{f"train_{n}": float(v.detach()) for n, v in losses.items()},
        }
        if eval_batch is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
            row.update(evaluate_offline(drafter, eval_batch, draft_length, cfg.loss))
            drafter.train()
        history.append(row)
        bar.update(1)
        bar.set_postfix(loss=f"{row['train_total']:.3f}")
        if ckpt is not None and (step % cfg.checkpoint_every == 0 or step == end):
            _save_checkpoint(ckpt, drafter, optimizer, step, cfg, history, settings)
    bar.close()
    drafter.eval()
    if out_dir is not None and step == cfg.steps:
        save_drafter(
            drafter,
            Path(out_dir) / "drafter",
            extra={"train": cfg.to_dict(), "seconds": time.perf_counter() - t0},
        )
    return pd.DataFrame(history)
