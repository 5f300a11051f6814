"""A decoder layer step's small operations, compiled (``step.cpp``): :func:`step_kernels`.

In a one-token step of a small model the weight products take about half the time; much of
the rest is PyTorch dispatching the thirty-odd small operations of each layer (a fused
RMSNorm alone is a dozen). ``step.cpp`` does three of them, each in one pass over float32
rows: ``rms_norm(x, weight, eps)``, ``rotate_(rows, cos, sin, heads)`` (the rotary
embedding of the first ``heads`` heads of ``[n, heads_total, d]`` rows, in place) and
``attend(q, keys, values, mask, scale)`` (the attention of a few queries ``[heads, n, d]``
over a cache's keys and values, the query heads grouped onto the key heads, query ``r``
not seeing the columns where row ``r`` of the ``[n, columns]`` bool mask is false), and
``attend_many(out, q, k, v, keys, values, bounds, starts, columns, masks, scale)``: several
caches' ``attend`` in one parallel region, each cache's block of keys and values written
into its storage first (a batched step of many sessions, once a layer instead of twice a
session); and ``move_slots``, eviction's moves of every layer's keys and values in one call.
They compute what PyTorch's operations compute, in float32, rounded
differently: a default-model forward through them is as close to its float64 forward as
through PyTorch's. The MLP's SiLU stays PyTorch's: a compiled one (``exp`` rounded
otherwise) saved little and moved the logits furthest from PyTorch's. ``layer.cpp``
composes them with a layer's four products into a whole decoder layer in one call:
``float_layer`` with float32 weights on the few-row product (``rows.cpp``), or with each
weight's exact integer form in its place (``exact.cpp``, the same bits), over the blocks of
one or more caches (a verifier's step, a batched step), and ``int4_layer`` (``int4.cpp``)
with the ``int4-vnni`` products, over one cache (a draft model's step).
:class:`~kakeya_lab.backends.torch_lean.LeanForward` runs them where they apply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kakeya_lab.native.build import compiled


@dataclass(frozen=True)
class StepKernels:
    """The compiled step operations (module docstring). Copying or pickling one (a model
    deep-copied with its lean forward) refers to this process's compiled module again,
    which cannot itself be copied."""

    rms_norm: Callable[..., torch.Tensor]
    rotate_: Callable[..., None]
    attend: Callable[..., torch.Tensor]
    attend_many: Callable[..., None]
    int4_layer: Callable[..., torch.Tensor]
    float_layer: Callable[..., torch.Tensor]

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _loaded_step_kernels, ()


def _loaded_step_kernels() -> StepKernels:
    module = compiled()
    if module is None:  # unpickled where the kernels do not build
        raise RuntimeError("the compiled step operations are not available in this process")
    return StepKernels(
        module.rms_norm,
        module.rotate_,
        module.attend,
        module.attend_many,
        module.int4_layer,
        module.float_layer,
    )


def step_kernels(
    dtype: torch.dtype, device: torch.device, hidden: int, head_dim: int
) -> StepKernels | None:
    """The compiled step operations when they take rows of this ``dtype`` on this
    ``device`` with these widths (float32 on the CPU, widths multiples of 16, heads of at
    most 128), else None
    (also when the kernels cannot be built here: :func:`~kakeya_lab.native.build.why_unavailable`)."""
    if dtype != torch.float32 or device.type != "cpu" or hidden % 16 or head_dim % 16:
        return None
    if head_dim > 128:  # attend keeps a head's output in 8 vector registers
        return None
    return None if compiled() is None else _loaded_step_kernels()


def move_slots(
    storages: list[torch.Tensor], sources: torch.Tensor, destinations: torch.Tensor
) -> bool:
    """Move the entries of slots ``sources`` to slots ``destinations`` in every storage
    ``[1, kv_heads, capacity, d]`` (each a cache layer's keys or values: eviction's moves,
    all layers in one compiled call, every source read before any destination is written).
    False, nothing moved, where the compiled kernels are unavailable or do not take these
    (a storage that is not a contiguous CPU tensor, indices not int64 on the CPU): then the
    caller moves them itself."""
    module = compiled()
    if module is None or not all(
        t.device.type == "cpu" and t.dim() == 4 and t.is_contiguous() for t in storages
    ):
        return False
    if any(t.dtype != torch.long or t.device.type != "cpu" for t in (sources, destinations)):
        return False
    module.move_slots(storages, sources.contiguous(), destinations.contiguous())
    return True
