"""Distillation losses of a drafter against the verifier's rollouts (docs/design.md, "Proposer alignment").

All three compare a drafter's predicted features with what the verifier did at the same
positions, masked to the positions worth training on:

* ``kl``: KL(verifier ‖ drafter) over the verifier's top-k tokens (those in the draft
  vocabulary), both softened by ``temperature``, scaled by ``temperature²``;
* ``feature``: smooth-L1 between the predicted and the verifier's hidden state;
* ``ce``: cross-entropy on the verifier's own (greedy) next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    kl: float = 1.0
    feature: float = 0.2
    ce: float = 0.2
    temperature: float = 1.0


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def topk_kl(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logits: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Per-row KL(teacher ‖ student) on the teacher's top-k ids.

    ``student_logits [..., V]`` over the student's vocabulary; ``teacher_ids [..., K]``
    rows of that vocabulary (``-1``: not in it, left out and the rest renormalised).
    """
    valid = teacher_ids >= 0
    t = (teacher_logits / temperature).masked_fill(~valid, float("-inf"))
    p = torch.softmax(t, dim=-1).nan_to_num(0.0)  # a row with no valid id contributes 0
    logq = torch.log_softmax(student_logits / temperature, dim=-1)
    logq = torch.gather(logq, -1, teacher_ids.clamp(min=0))
    logp = torch.log(p.clamp(min=1e-30))
    return (p * (logp - logq)).masked_fill(~valid, 0.0).sum(-1) * temperature**2


def distill_losses(
    logits: torch.Tensor,
    pred_features: torch.Tensor,
    target_features: torch.Tensor,
    teacher_rows: torch.Tensor,
    teacher_logits: torch.Tensor,
    target_rows: torch.Tensor,
    mask: torch.Tensor,
    weights: LossWeights,
) -> dict[str, torch.Tensor]:
    """The three losses and their weighted ``total`` (each a masked mean over positions).

    ``logits [..., Vd]`` drafter logits; ``teacher_rows``/``target_rows`` ids already
    mapped to draft-vocabulary rows (``-1`` outside it); ``mask [...]`` positions to train.
    """
    kl = _masked_mean(topk_kl(logits, teacher_rows, teacher_logits, weights.temperature), mask)
    feature = _masked_mean(
        F.smooth_l1_loss(pred_features, target_features, reduction="none").mean(-1), mask
    )
    ce_mask = mask & (target_rows >= 0)
    ce_rows = F.cross_entropy(
        logits.flatten(0, -2), target_rows.clamp(min=0).flatten(), reduction="none"
    ).view(target_rows.shape)
    ce = _masked_mean(ce_rows, ce_mask)
    total = weights.kl * kl + weights.feature * feature + weights.ce * ce
    return {"total": total, "kl": kl, "feature": feature, "ce": ce}
