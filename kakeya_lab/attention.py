"""Sink-window attention: the one place where the oracle's visibility rule is applied.

transformers calls ``past_key_values.update(k, v, layer_idx)`` and then the registered
attention function, in that order, inside every attention module. Our cache's ``update``
publishes a :class:`KeyLayout` (absolute position of every key column it returns, and the
positions of the new queries); :func:`sink_window_attention` consumes it and builds the
per-query mask of DESIGN.md from positions alone:

    query at p sees key j  iff  0 <= j <= p  and  (j < sink  or  p - j < window)

In ``rolling`` mode the sink columns are scored with the query rotated to
``min(p, sink + window - 1)``, so that each query sees the sinks at the StreamingLLM
distance ``sink + window - 1 - j`` while window keys keep their true distance. That makes
multi-token blocks exact in one forward (no token-by-token fallback).

When no layout is published (a forward without a :class:`~kakeya_lab.cache.SinkWindowCache`,
e.g. the dense reference) the function defers to transformers' own SDPA attention with
whatever mask the model built, so the oracle does not run through this code.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "kakeya_sink_window"

_local = threading.local()


@dataclass
class KeyLayout:
    """What one ``update`` call returned, in terms of positions.

    ``key_positions[c]`` is the absolute position held in key column ``c`` (``-1`` for an
    empty slot); ``query_positions`` are the absolute positions of the new tokens.
    ``visible`` is the oracle mask ``[queries, keys]`` (see :func:`visibility`).
    ``sink_query_shift[i]`` (rolling mode only) is how far query ``i`` is rotated before
    scoring the sink columns; ``None`` in global mode.
    """

    layer_idx: int
    key_positions: torch.Tensor
    query_positions: torch.Tensor
    sink: int
    window: int | None
    visible: torch.Tensor
    sink_query_shift: torch.Tensor | None
    inv_freq: torch.Tensor | None


def publish(layout: KeyLayout) -> None:
    """Hand the layout of the keys just returned by a cache to the next attention call."""
    pending = getattr(_local, "layout", None)
    if pending is not None:
        _local.layout = None
        raise RuntimeError(
            "the previous sink-window key layout was never consumed: the model is not using "
            f"the {ATTN_IMPLEMENTATION!r} attention. Load it with kakeya_lab.load_model or call "
            "kakeya_lab.attention.enable_sink_window_attention(model) first."
        )
    _local.layout = layout


def take(layer_idx: int) -> KeyLayout | None:
    """Take the published layout (if any) for ``layer_idx``; clears it."""
    layout = getattr(_local, "layout", None)
    if layout is None:
        return None
    _local.layout = None
    if layout.layer_idx != layer_idx:
        raise RuntimeError(
            f"sink-window layout for layer {layout.layer_idx} consumed by layer {layer_idx}"
        )
    return layout


def discard() -> None:
    """Forget an unconsumed layout (after an exception inside a forward)."""
    _local.layout = None


def rotate(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply a RoPE rotation by ``shift`` positions to already-rotated vectors.

    ``x``: ``[..., n, head_dim]``; ``shift``: ``[n]`` (integer positions). Rotations
    compose, so a key rotated at position ``a`` becomes one rotated at ``a + shift``.
    Uses the rotate-half convention of Llama/Qwen in transformers.
    """
    angles = shift.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


def visibility(
    query_positions: torch.Tensor, key_positions: torch.Tensor, sink: int, window: int | None
) -> torch.Tensor:
    """The oracle mask ``[q, k]`` (True = attend) from absolute positions."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= (k < sink) | (q - k < window)
    return visible


def sink_window_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kakeya_sink_window"`` (see module docstring)."""
    layout = take(module.layer_idx)
    if layout is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is None and q_len > 1 and kv_len > q_len:
            # No mask was built for this implementation: causal, aligned to the last key
            # (SDPA's own is_causal would align queries to the first key).
            offset = kv_len - q_len
            attention_mask = (
                torch.arange(kv_len, device=query.device)[None, :]
                <= torch.arange(q_len, device=query.device)[:, None] + offset
            )[None, None]
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and not torch.equal(
        position_ids.reshape(-1).to(layout.query_positions.device), layout.query_positions
    ):
        raise RuntimeError(
            "position_ids passed to the model do not match the sink-window cache's positions "
            f"({position_ids.reshape(-1)[:4].tolist()}... vs {layout.query_positions[:4].tolist()}...)"
        )
    bsz, n_heads, q_len, head_dim = query.shape
    if bsz != 1:
        raise ValueError("the sink-window cache holds one sequence (batch size 1)")
    n_kv = key.shape[1]
    groups = n_heads // n_kv
    scale = scaling if scaling is not None else head_dim**-0.5
    # Grouped-query attention without copying keys: fold the query groups into rows.
    q = query.reshape(n_kv, groups * q_len, head_dim)
    k = key[0]
    v = value[0]
    scores = torch.matmul(q, k.transpose(1, 2)).reshape(n_kv, groups, q_len, -1)
    if layout.sink_query_shift is not None:
        sink_cols = torch.nonzero(
            (layout.key_positions >= 0) & (layout.key_positions < layout.sink)
        ).flatten()
        if sink_cols.numel() and bool((layout.sink_query_shift != 0).any()):
            q_sink = rotate(query[0], layout.sink_query_shift, layout.inv_freq)
            q_sink = q_sink.reshape(n_kv, groups * q_len, head_dim)
            sink_scores = torch.matmul(q_sink, k[:, sink_cols].transpose(1, 2))
            scores[..., sink_cols] = sink_scores.reshape(n_kv, groups, q_len, -1)
    scores = scores * scale
    scores = scores.masked_fill(~layout.visible, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(weights.reshape(n_kv, groups * q_len, -1), v)
    out = out.reshape(n_kv, groups, q_len, head_dim).reshape(1, n_heads, q_len, head_dim)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, sink_window_attention)


@contextmanager
def standard_attention(model: PreTrainedModel, implementation: str = "sdpa") -> Iterator[PreTrainedModel]:
    """Temporarily run ``model`` with a stock transformers attention (for baselines such as
    transformers' own assisted generation), restoring the previous one afterwards."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def enable_sink_window_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model`` to the sink-window attention function (idempotent).

    Without a :class:`~kakeya_lab.cache.SinkWindowCache` the function behaves like SDPA, so
    the model stays usable for ordinary forwards and dense references.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
