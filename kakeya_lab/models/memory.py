"""Where a loaded model's weights live: one block of huge pages, in the order a step reads them.

A one-token step reads every weight once, so it runs at the speed memory streams them.
transformers leaves a safetensors model's parameters in a private mapping of its file:
4 KiB pages of the page cache, one tensor wherever the file put it. On this machine kind
(2 cores, Zen 4) a pass over a tensor in 2 MiB pages (transparent huge pages) ran 10–23%
faster than over the same bytes in 4 KiB pages (measured, interleaved; one TLB entry covers
512 times as much, which is the likely reason).

:func:`place_weights` copies a model's parameters, back to back in their module order, into
one anonymous mapping advised to use huge pages (:func:`huge_page_tensor`), and makes each
parameter a view of it: the same ``nn.Parameter`` objects (tied weights stay tied, hooks and
optimisers see no change), the same values, the file's mapping released. Llama's q/k/v and
gate/up projections come out consecutive, so the lean step's stacked weights
(:func:`kakeya_lab.linear.stack_rows`) are views of the block rather than new copies.
Where the kernel does not give huge pages (``transparent_hugepage`` set to ``never``, or
no ``madvise``) the block is ordinary memory, as fast as before.
"""

from __future__ import annotations

import mmap
from collections import defaultdict

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # bytes: the x86-64 transparent huge page


def huge_page_tensor(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new 1-D tensor of ``numel`` zeros in an anonymous mapping advised to use
    transparent huge pages, starting on a huge-page boundary. The tensor keeps the mapping
    alive; the pages are taken as they are first written."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    block = mmap.mmap(-1, numel * itemsize + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        block.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(block, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    return raw[skip : skip + numel * itemsize].view(dtype)


def place_weights(model: nn.Module) -> int:
    """Move ``model``'s parameters into huge pages (module docstring): per dtype, one
    :func:`huge_page_tensor` holding them back to back in ``named_parameters`` order, each
    parameter becoming a view of it (``param.data``; a tied parameter once). Values,
    ``requires_grad`` and the parameter objects are unchanged. Returns the bytes placed."""
    groups: dict[torch.dtype, list[nn.Parameter]] = defaultdict(list)
    for _, param in model.named_parameters():  # each shared Parameter once
        if param.device.type == "cpu":
            groups[param.dtype].append(param)
    placed = 0
    with torch.no_grad():
        for dtype, params in groups.items():
            block = huge_page_tensor(sum(p.numel() for p in params), dtype)
            start = 0
            for param in params:
                view = block[start : start + param.numel()].view(param.shape)
                view.copy_(param)
                param.data = view
                start += param.numel()
            placed += block.nbytes
    return placed
