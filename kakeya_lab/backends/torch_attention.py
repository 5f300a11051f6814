"""The sink-window rule as a transformers attention mask, and torch RoPE rotation.

The rule and the key layout are computed by the backend-neutral
:class:`~kakeya_lab.backends.plan.SlotPlan` (:func:`kakeya_lab.backends.plan.key_layout`);
this module only carries that layout into transformers' attention (transformers 5.x,
Llama/Qwen-style models). A forward calls ``create_causal_mask(..., cache=cache)``
(``past_key_values=`` before 5.24) once, before any layer. That asks the cache
``get_mask_sizes(query_length, layer_idx)`` and passes the answer to the mask function
registered for the model's attention implementation. A
:class:`~kakeya_lab.backends.torch_cache.SinkWindowCache` answers with a :class:`LayoutMask`
(the plan's layout and its mask as a torch tensor) in the ``kv_offset`` slot (for a
position-ordered cache that slot holds "the position of the first key column"; ours holds
the position of *each* column). :func:`sink_window_mask`, registered as the mask function of
``"kakeya_sink_window"``, returns its mask; every layer then runs transformers' stock SDPA
attention with it. Nothing is handed over outside those return values. Without a
sink-window cache (no cache, a ``DynamicCache``, or an explicit 4-D mask such as the dense
reference's) the model gets transformers' own SDPA mask, so ordinary forwards are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kakeya_lab.backends.plan import KeyLayout

ATTN_IMPLEMENTATION = "kakeya_sink_window"


@dataclass(frozen=True)
class LayoutMask:
    """A forward's :class:`~kakeya_lab.backends.plan.KeyLayout` with its 4-D boolean
    attention mask ``[1, 1, queries, columns]`` (True = attend) on the model's device, made
    when first asked for (a one-token step that sees every column needs none)."""

    layout: KeyLayout
    device: torch.device

    @classmethod
    def of(cls, layout: KeyLayout, device: torch.device) -> LayoutMask:
        return cls(layout, device)

    @cached_property
    def mask(self) -> torch.Tensor:
        return torch.from_numpy(self.layout.visible).to(self.device)[None, None]

    @property
    def sees_all(self) -> bool:
        """Whether every query sees every column (then no mask is needed)."""
        return bool(self.layout.visible.all())

    @property
    def num_columns(self) -> int:
        return self.layout.num_columns


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
    """The oracle mask ``[q, k]`` (True = attend) from absolute positions, as torch
    tensors (the dense reference's; :func:`kakeya_lab.backends.plan.visibility` in numpy)."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= (k < sink) | (q - k < window)
    return visible


def sink_window_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int | LayoutMask = 0,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function of ``"kakeya_sink_window"``: ``layout.mask`` for a sink-window cache,
    transformers' SDPA mask for anything else."""
    if isinstance(kv_offset, LayoutMask):
        shape = tuple(kv_offset.mask.shape[2:])
        if batch_size != 1 or shape != (q_length, kv_length):
            raise RuntimeError(
                f"sink-window layout {shape} does not fit a forward of "
                f"{batch_size} x {q_length} tokens over {kv_length} key columns"
            )
        return kv_offset.mask
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
    forward runs over a :class:`~kakeya_lab.backends.torch_cache.SinkWindowCache`, so the model stays
    usable for ordinary forwards and dense references.
    """
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
