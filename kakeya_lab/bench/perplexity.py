"""Per-token negative log-likelihood of a long text under different attention budgets
(the attention-sink experiment of Xiao et al. 2023, "StreamingLLM").

* :func:`streaming_nll` — the text streamed through a :class:`~kakeya_lab.verifier.Verifier`
  with a given :class:`~kakeya_lab.backends.config.SinkWindowConfig` (dense = ``window=None``,
  window-only = ``sink=0``, sink + window in either position mode). Each token is scored
  with exactly the oracle's context.
* :func:`sliding_recompute_nll` — sliding window with re-computation: every block of
  ``stride`` targets is scored by a fresh dense forward over the ``window`` tokens before
  it (no cache; the quality reference at quadratic cost).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.verifier import Verifier


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none").numpy()


def streaming_nll(
    model,
    token_ids: Sequence[int],
    config: SinkWindowConfig,
    *,
    chunk: int = 64,
    progress: bool = False,
) -> np.ndarray:
    """NLL of ``token_ids[1:]`` (nats), each predicted under the sink-window rule."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("need at least two tokens")
    v = Verifier(model, config)
    out = []
    for i in tqdm(range(0, len(ids) - 1, chunk), disable=not progress, desc=str(config.to_dict())):
        block = ids[i : i + chunk]
        logits = v.forward_block(block)
        v.commit(len(block))
        targets = torch.tensor(ids[i + 1 : i + 1 + len(block)])
        out.append(_nll(logits[: len(targets)], targets))
    return np.concatenate(out)


@torch.inference_mode()
def sliding_recompute_nll(
    model, token_ids: Sequence[int], *, window: int, stride: int = 32, progress: bool = False
) -> np.ndarray:
    """NLL of ``token_ids[1:]`` where target ``t`` sees at most the ``window`` tokens
    before it, recomputed from scratch for every ``stride`` targets (positions from 0)."""
    from kakeya_lab.backends.torch_attention import standard_attention

    ids = list(token_ids)
    out = np.zeros(len(ids) - 1)
    with standard_attention(model):
        for end in tqdm(range(1, len(ids), stride), disable=not progress, desc="sliding recompute"):
            last = min(end + stride, len(ids))  # targets ids[end:last]
            start = max(0, last - 1 - window)  # context covers the last target's window
            x = torch.tensor([ids[start : last - 1]])
            logits = model(input_ids=x, use_cache=False).logits[0]
            rel = torch.arange(end - 1 - start, last - 1 - start)
            out[end - 1 : last - 1] = _nll(logits[rel], torch.tensor(ids[end:last]))
    return out


def moving_average(values: np.ndarray, width: int) -> np.ndarray:
    if width <= 1:
        return values
    kernel = np.ones(width) / width
    return np.convolve(values, kernel, mode="valid")
