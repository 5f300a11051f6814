"""A compiled product of a few float32 rows by int4 weights on integer dot products:
:func:`int4_product` (the ``int4-vnni`` linear kernel, :mod:`kakeya_lab.linear`).

A draft model's one-token step on PyTorch's int4 kernel spends most of its products turning
every 4-bit weight into a bfloat16 one before it multiplies: on this kind of machine
(2 cores, Zen 4) it reads the packed weights at a fraction of what the memory gives.
``int4.cpp`` turns the rows into integers instead: each row, per group of 32 inputs, as two
int8 parts (the row rounded to 127 steps of the group's largest input, then that rounding's
error rounded to 254 steps of one step; about 15 bits, finer than bfloat16's 8), with the
group's exact sum kept for the offsets. It multiplies 4-bit by 8-bit integers with AVX-512
VNNI, 16 output rows a vector, so a one-token step is bound by reading the 4.5 bits a
weight, and a prefill's rows cost less than oneDNN's float32 product. The weights are the
same int4 weights as ``int4``'s (:func:`kakeya_lab.linear.quantize_int4`), laid out by
:func:`pack`; the product is the dequantised weights' to about 1e-5 of its size (``int4``'s
bfloat16 rows: about 3e-3).

It is compiled with the other kernels of this folder (:mod:`kakeya_lab.native.build`) and
runs on CPUs with AVX-512 BW and VNNI (:func:`why_unavailable`)."""

from __future__ import annotations

import torch

from kakeya_lab.native.build import compiled
from kakeya_lab.native.build import why_unavailable as why_not_built
from kakeya_lab.results import cpu_identity

GROUP = 32  # inputs per scale and offset (int4.cpp's GROUP)
TILE_ROWS = 64  # output rows per tile (int4.cpp's 4 blocks of 16)
CPU_FLAGS = ("avx512bw", "avx512_vnni")


def why_unavailable() -> str:
    """Why :func:`int4_product` cannot run here ("" when it can)."""
    missing = [flag for flag in CPU_FLAGS if flag not in cpu_identity()["cpu_flags"]]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if compiled() is None:
        return f"the compiled kernels are unavailable: {why_not_built()}"
    return ""


def fits(out_features: int, in_features: int) -> bool:
    """Whether :func:`pack` tiles a weight of this shape."""
    return out_features % TILE_ROWS == 0 and in_features % GROUP == 0


def pack(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``int4.cpp``'s layout of int4 weights (:func:`kakeya_lab.linear.quantize_int4`:
    ``q`` 0..15 ``[out, in]``, bfloat16 ``scale`` and ``offset`` ``[out, in / 32]``):
    ``(packed, scales)``, ``packed`` uint8 ``[out / 64, in / 8, 4, 16, 4]`` (two inputs a
    byte) and ``scales`` bfloat16 ``[out / 64, in / 32, 4, 2, 16]``."""
    out, width = q.shape
    if not fits(out, width):
        raise ValueError(f"int4 packing takes out % {TILE_ROWS} == 0 and in % {GROUP} == 0")
    tiles = out // TILE_ROWS
    # [tile, block, lane, step, half, j]: inputs 8 step + 4 half + j of output 64 t + 16 b + i
    nibbles = q.to(torch.uint8).view(tiles, 4, 16, width // 8, 2, 4)
    byte = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)
    packed = byte.permute(0, 3, 1, 2, 4).contiguous()
    pairs = torch.stack([scale.to(torch.bfloat16), offset.to(torch.bfloat16)], dim=-1)
    scales = pairs.view(tiles, 4, 16, width // GROUP, 2).permute(0, 3, 1, 4, 2).contiguous()
    return packed, scales


def int4_product(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` for float32 ``rows`` ``[n, in]`` and the int4 weight packed by
    :func:`pack`, the rows as two int8 parts per group of 32 (module docstring); float32
    ``[n, out]``. Raises RuntimeError where it cannot run (:func:`why_unavailable`)."""
    module = compiled()
    if module is None:
        raise RuntimeError(f"int4_product is unavailable: {why_unavailable()}")
    return module.int4_product(rows.contiguous(), packed, scales)
