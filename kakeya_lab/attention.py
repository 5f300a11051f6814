"""Sink-window visibility: where the oracle's rule becomes an attention mask.

    query at p sees key j  iff  0 <= j <= p  and  (j < sink  or  p - j < window)

How the rule reaches each layer's attention (transformers 5.x, Llama/Qwen-style models): a
forward calls ``create_causal_mask(..., cache=cache)`` (``past_key_values=`` before 5.24) once, before any layer.
That asks the cache ``get_mask_sizes(query_length, layer_idx)`` and passes the answer to the
mask function registered for the model's attention implementation. A
:class:`~kakeya_lab.cache.SinkWindowCache` answers with a :class:`KeyLayout` — the absolute
position of every key column its layers will return in this forward and the positions of
the new queries — in the ``kv_offset`` slot (for a position-ordered cache that slot holds
"the position of the first key column"; ours holds the position of *each* column).
:func:`sink_window_mask`, registered as the mask function of ``"kakeya_sink_window"``,
returns ``layout.mask``; every layer then runs transformers' stock SDPA attention with it.
Nothing is handed over outside those return values. Without a sink-window cache (no cache,
a ``DynamicCache``, or an explicit 4-D mask such as the dense reference's) the model gets
transformers' own SDPA mask, so ordinary forwards are unchanged.

``rolling`` positions: each query at ``p > sink + window - 1`` must see sink ``j`` at the
StreamingLLM distance ``sink + window - 1 - j`` while window keys keep their true distance.
One rotation of the cached keys cannot serve several queries, so the cache's layers append
*per-query copies* of the sink keys, rotated forward by ``p - (sink + window - 1)``, as
extra key columns (:class:`SinkCopies`); the mask lets query ``p`` see only its own copies
and hides the original sink columns from it. Cost: ``sink`` extra key columns per such query
(``n * sink`` for an ``n``-token block, e.g. 4 for single-token decoding with 4 sinks), held
in scratch slots after the block and never counted as live. Exact in one forward; no
token-by-token fallback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "kakeya_sink_window"


@dataclass(frozen=True)
class SinkCopies:
    """Rolling mode: per-query rotated copies of the sink keys, appended as key columns.

    ``source_columns`` ``[s]``: the key columns holding the sinks; ``shifts`` ``[m]``: for each
    query that needs copies, by how many positions its ``s`` copies are rotated forward.
    The copies occupy ``m * s`` columns after the regular ones, query-major.
    """

    source_columns: torch.Tensor
    shifts: torch.Tensor

    @property
    def num_columns(self) -> int:
        return self.source_columns.numel() * self.shifts.numel()


@dataclass(frozen=True)
class KeyLayout:
    """The key columns of one forward through a sink-window cache, in positions.

    ``key_positions[c]``: absolute position held by regular key column ``c`` (``-1``: empty);
    ``query_positions``: the new tokens' positions; ``visible``: ``[queries, columns]``
    (regular columns, then the rolling-mode sink copies, if any).
    """

    key_positions: torch.Tensor
    query_positions: torch.Tensor
    visible: torch.Tensor
    copies: SinkCopies | None

    @property
    def num_columns(self) -> int:
        return self.visible.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """The 4-D boolean attention mask ``[1, 1, queries, columns]`` (True = attend)."""
        return self.visible[None, None]


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


def key_layout(
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    sink: int,
    window: int | None,
    rolling: bool,
    ancestors: torch.Tensor | None = None,
) -> KeyLayout:
    """The layout of a forward whose regular key columns hold ``key_positions``.

    With ``rolling`` (and a window), queries past ``sink + window - 1`` get their own
    rotated sink copies (see the module docstring). ``ancestors`` (a draft tree's
    ``[q, q]`` mask, :meth:`kakeya_lab.tree.DraftTree.ancestor_mask`) restricts the last
    ``q`` key columns — the block's own — on top of the visibility rule: a node sees only
    its own path there.
    """
    visible = visibility(query_positions, key_positions, sink, window)
    if ancestors is not None:
        q = query_positions.numel()
        visible[:, visible.shape[1] - q :] &= ancestors.to(visible.device)
    copies = None
    if rolling and window is not None:
        shift = torch.clamp(query_positions - (sink + window - 1), min=0)
        rows = torch.nonzero(shift > 0).flatten()
        sink_cols = torch.nonzero((key_positions >= 0) & (key_positions < sink)).flatten()
        if rows.numel() and sink_cols.numel():
            s, m = sink_cols.numel(), rows.numel()
            copy_visible = torch.zeros(
                (query_positions.numel(), m * s), dtype=torch.bool, device=visible.device
            )
            copy_visible[rows.repeat_interleave(s), torch.arange(m * s, device=visible.device)] = (
                visible[rows][:, sink_cols].reshape(-1)
            )
            visible[rows[:, None], sink_cols[None, :]] = False
            visible = torch.cat([visible, copy_visible], dim=1)
            copies = SinkCopies(source_columns=sink_cols, shifts=shift[rows])
    return KeyLayout(key_positions, query_positions, visible, copies)


def sink_window_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int | KeyLayout = 0,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function of ``"kakeya_sink_window"``: ``layout.mask`` for a sink-window cache,
    transformers' SDPA mask for anything else."""
    if isinstance(kv_offset, KeyLayout):
        layout = kv_offset
        if batch_size != 1 or layout.visible.shape != (q_length, kv_length):
            raise RuntimeError(
                f"sink-window layout {tuple(layout.visible.shape)} does not fit a forward of "
                f"{batch_size} x {q_length} tokens over {kv_length} key columns"
            )
        return layout.mask
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        **kwargs,
    )


AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sink_window_mask)
AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)


@contextmanager
def standard_attention(
    model: PreTrainedModel, implementation: str = "sdpa"
) -> Iterator[PreTrainedModel]:
    """Temporarily run ``model`` with a stock transformers attention (for baselines such as
    transformers' own assisted generation), restoring the previous one afterwards."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def enable_sink_window_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model`` to the ``"kakeya_sink_window"`` implementation (idempotent).

    The attention itself is transformers' SDPA; only the mask differs, and only when the
    forward runs over a :class:`~kakeya_lab.cache.SinkWindowCache`, so the model stays
    usable for ordinary forwards and dense references.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
