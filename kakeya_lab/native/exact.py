"""A float32 weight read from its exact integer form: :func:`exact_product`.

The store's models are dequantised GGUF files, whose blocks dequantise to float32 weights
that hold far fewer than 32 bits each. Per group of 32 inputs of a row, a 4-bit block
(``Q4_1``: the default model's decoder layers) is ``w = q * d + m`` with ``q`` in 0..15, ``d``
a float16 value and ``m`` a float32; an 8-bit block (``Q8_0``: its embedding, tied to the
output layer) is ``w = q * d`` with ``q`` in -128..127. :func:`pack` finds ``q``, ``d`` (and
``m``) for every group, trying the 4-bit form first, and returns them only when they give
back the whole weight bit for bit; any other weight (a random model's, a float16 or k-quant
GGUF's) is not packed. ``exact.cpp`` multiplies a few rows by the packed form: the same
weights, the same sums in the same order as the compiled few-row product
(:mod:`kakeya_lab.native.rows`), so the same bits, from a sixth (4-bit) or a third (8-bit)
of the bytes: the ``exact`` linear kernel (:mod:`kakeya_lab.linear`).

:func:`packed` keeps each weight tensor's packed form while the tensor lives (made on first
use, made again when the tensor is changed in place), so layers that a forward runs stacked
are packed as their stacks.
"""

from __future__ import annotations

import threading
import weakref

import torch

from kakeya_lab.native.build import compiled

GROUP = 32  # inputs per d (and m) (exact.cpp's GROUP)
MAX_ROWS = 16  # the most rows exact_product takes
_PROBE_GROUPS = 4096  # groups tried first: a weight of another kind fails here, cheaply

# (codes, so): 4-bit codes [out, in / 2] uint8 with so [out, in / 32, 2] (d, m); 8-bit codes
# [out, in] int8 with so [out, in / 32, 1] (d)
Packed = tuple[torch.Tensor, torch.Tensor]

_lock = threading.Lock()
# id(weight) -> (a reference to it, its version when packed, its packed form or None: not
# exact); by identity (a tensor's == is elementwise), dropped when the tensor is freed
_packed: dict[int, tuple[weakref.ref[torch.Tensor], int, Packed | None]] = {}


def _steps(guess: torch.Tensor) -> list[torch.Tensor]:
    """The float16 values at and next to ``guess`` (float32; rounding on the way to it can
    put the true step one or two float16 steps off), as float32."""
    half = guess.to(torch.float16).view(torch.int16)
    return [(half + shift).view(torch.float16).float() for shift in (0, -1, 1, -2, 2)]


def _solve4(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(q, d, m)`` with ``q * d + m == groups`` exactly for every group (``[g, 32]``),
    q in 0..15, d float16-valued, m the group's least value; None when a group has none."""
    low, high = groups.amin(dim=1), groups.amax(dim=1)
    d = torch.zeros_like(low)
    q = torch.zeros_like(groups)
    found = high == low  # a group of one value: q = 0 (d unused)
    for step in _steps((high - low) / 15):
        step = torch.where(found, torch.ones_like(step), step)
        levels = torch.round((groups - low[:, None]) / step[:, None]).clamp_(0, 15)
        exact = (levels * step[:, None] + low[:, None] == groups).all(dim=1) & ~found
        d = torch.where(exact, step, d)
        q = torch.where(exact[:, None], levels, q)
        found |= exact
        if bool(found.all()):
            return q, d, low
    return None


def _solve8(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(q, d)`` with ``q * d == groups`` exactly for every group, q in -128..127 and d
    float16-valued (the greatest magnitude at q = ±127); None when a group has none."""
    top = groups.abs().amax(dim=1)
    d = torch.zeros_like(top)
    q = torch.zeros_like(groups)
    found = top == 0  # a group of zeros: q = 0
    for step in _steps(top / 127):
        step = torch.where(found | (step == 0), torch.ones_like(step), step)
        levels = torch.round(groups / step[:, None]).clamp_(-128, 127)
        exact = (levels * step[:, None] == groups).all(dim=1) & ~found
        d = torch.where(exact, step, d)
        q = torch.where(exact[:, None], levels, q)
        found |= exact
        if bool(found.all()):
            return q, d
    return None


def pack(weight: torch.Tensor) -> Packed | None:
    """The exact integer form of a 2-D float32 CPU ``weight`` whose input width is a
    multiple of 32, as ``exact.cpp`` takes it (``(codes, so)``, :data:`Packed`): the 4-bit
    form where every group has one, else the 8-bit form where every group has one, else
    None (so also for other dtypes and shapes)."""
    if (
        weight.dim() != 2
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or weight.shape[1] % GROUP
        or weight.numel() == 0
    ):
        return None
    out, width = weight.shape
    with torch.no_grad():
        groups = weight.detach().reshape(out * (width // GROUP), GROUP)
        probe = groups[:_PROBE_GROUPS]
        four = _solve4(groups) if _solve4(probe) is not None else None
        if four is not None:
            q, d, m = four
            nibbles = q.to(torch.uint8).view(out, width // GROUP, 2, 16)
            codes = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(out, width // 2)
            so = torch.stack([d, m], dim=-1).view(out, width // GROUP, 2)
            return codes.contiguous(), so.contiguous()
        eight = _solve8(groups) if _solve8(probe) is not None else None
        if eight is not None:
            q, d = eight
            codes = q.to(torch.int8).view(out, width)
            return codes.contiguous(), d.view(out, width // GROUP, 1).contiguous()
    return None


def version(weight: torch.Tensor) -> int:
    """The tensor's in-place change counter; -1 for a tensor made in inference mode, which
    has none (such a tensor is taken as unchanged)."""
    return -1 if weight.is_inference() else weight._version


def packed(weight: torch.Tensor) -> Packed | None:
    """:func:`pack` of ``weight``, kept while the tensor lives and is not changed in place
    (its version counter), so each weight is packed once."""
    key = id(weight)
    with _lock:
        entry = _packed.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == version(weight):
            return entry[2]
    form = pack(weight)  # outside the lock: other weights pack meanwhile
    with _lock:
        entry = _packed.get(key)
        if entry is not None and entry[0]() is weight:
            ref = entry[0]
        else:
            ref = weakref.ref(weight)
            weakref.finalize(weight, _forget, key, ref)
        _packed[key] = (ref, version(weight), form)
    return form


def is_packed(weight: torch.Tensor) -> bool:
    """Whether :func:`packed` holds an exact integer form of ``weight`` as it is now."""
    entry = _packed.get(id(weight))
    return (
        entry is not None
        and entry[0]() is weight
        and entry[1] == version(weight)
        and entry[2] is not None
    )


def forget(weight: torch.Tensor) -> None:
    """Drop what :func:`packed` keeps for ``weight`` (made again on its next use): for a
    weight packed only to be measured, whose form would otherwise stay while it lives."""
    with _lock:
        entry = _packed.get(id(weight))
        if entry is not None and entry[0]() is weight:
            del _packed[id(weight)]


def _forget(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    with _lock:
        entry = _packed.get(key)
        if entry is not None and entry[0] is ref:
            del _packed[key]


def exact_product(rows: torch.Tensor, form: Packed) -> torch.Tensor | None:
    """``rows @ weight.T`` for 1 to :data:`MAX_ROWS` float32 rows ``[n, in]`` and the packed
    ``form`` of the weight (:func:`pack`): bit for bit the compiled few-row product's; None
    when the compiled kernels are unavailable or the rows do not fit. No autograd."""
    module = compiled()
    if (
        module is None
        or rows.dtype != torch.float32
        or rows.device.type != "cpu"
        or not 1 <= rows.shape[0] <= MAX_ROWS
    ):
        return None
    return module.exact_product(rows.contiguous(), *form)
