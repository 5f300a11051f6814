"""Next-token sampling shared by plain and speculative decoding."""

from __future__ import annotations

import torch


def sample_token(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """Greedy (``temperature == 0``) or sampled next token from ``logits [vocab]``."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def sampling_probs(
    logits: torch.Tensor, *, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p (nucleus)."""
    scores = logits.float() / temperature
    if top_k is not None and 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
