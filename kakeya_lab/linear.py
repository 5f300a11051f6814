"""Which matrix-multiply kernel a torch model's linear layers run on the CPU.

A verification step multiplies a block of a few rows (the drafted tokens) by every weight
matrix of the model. PyTorch's default CPU path (``aten``: ``torch.nn.functional.linear``,
MKL's sgemm in this build) runs 2 or 3 rows as that many matrix-vector products and packs
the weights for 4 or more, so on this kind of machine a block of a few tokens costs two to
three times a one-token step, which is what speculative decoding has to beat. ``onednn``
routes the same layers through oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, the
kernel ``torch.compile`` freezes CPU linears into), which reads the weights once for a few
rows: a block of 4 or 8 costs little more than one token (``benchmarks/verify_cost.py``).

The weights are not copied or changed; each ``nn.Linear`` keeps its parameters and only its
forward changes, so :func:`set_linear_kernel` is reversible and the model's ``weight_sha256``
stays what it was. The two kernels agree to float32 rounding (about 1e-4 on logits), like a
block forward and a one-token forward already do; a comparison of speeds is only fair when
plain decoding and the speculative arm run the same kernel, which holds because the kernel is
a property of the loaded model that both share. While gradients are being recorded for a
layer's weight or input, the layer falls back to ``aten`` (oneDNN's op has no backward).

``split`` spreads a few-row product over the threads: PyTorch runs a one-row product
(a matrix-vector product) on one core whatever its thread count, and one core cannot read
the weights as fast as the machine can. ``split`` views each weight as one slice of its
output rows per thread (``weight.view(threads, out // threads, in)``, no copy) and multiplies
the rows by every slice in one batched product (``torch.bmm``), whose batches run in
parallel; one row as ``slice @ row`` (a streaming matrix-vector product, each output one
contiguous weight row against the input), more as ``rows @ slice.T``. A layer whose output
width the thread count does not divide runs ``aten``. Where the compiled few-row product
(:mod:`kakeya_lab.native.rows`: AVX-512 or AVX2, built once per machine) is available,
``split`` runs 1 to 16 float32 rows on it instead: it reads each weight row once for all the
rows, so a block of a few tokens costs little more than one (the output rows still split over
the threads), one row reads the weights faster than MKL's matrix-vector product, it rounds at
least as closely as MKL, and a row's output does not depend on the rows that come with it.

``exact`` computes ``split``'s numbers, to the bit, from fewer bytes. The store's models are
dequantised GGUF files, and a GGUF's 4-bit (``Q4_1``) and 8-bit (``Q8_0``) blocks dequantise
to float32 weights that are exactly ``q * d + m`` or ``q * d`` per group of 32 inputs (small
integers ``q``, a float16 ``d``). Where a weight is so (the default model's every weight is),
``exact`` reads it in that form (:mod:`kakeya_lab.native.exact`: found and packed on first use,
kept beside the weight, 0.75 or 1.125 bytes a weight instead of 4) and rebuilds each float32
weight in registers before the same multiply-adds in the same order as the few-row product;
other weights, and more than 16 rows, run ``split``. It changes no number, so it is plain
decoding of the same model, a candidate for the fastest plain baseline like the others.

Which of them is fastest depends on the CPU: ``auto`` measures them all on this machine
for one to sixteen rows and for a prefill chunk, caches the choice on disk per model, dtype,
CPU, torch version and thread count, and runs each call on the winner for its row count
(:mod:`kakeya_lab.linear_auto`); its numbers are those of the kernel it dispatches to.

``int8`` and ``int4`` are different in kind: they multiply by a quantised copy of each
weight matrix with the activations in bfloat16 (``int8``: one scale per output row,
symmetric, ``torch._weight_int8pack_mm``; ``int4``: a scale and an offset per 32 inputs of a
row, ``torch._weight_int4pack_mm_for_cpu``), which cuts the bytes a one-token step reads to a
half or a quarter of bfloat16's (a prefill of many rows still multiplies by the weights).
They change the model's numbers (by about the size of the rounding), so they are meant for
a *draft* model, whose numbers only decide how many drafted tokens the verifier accepts,
never what it emits. The parameters stay as they were (the quantised copy lives beside
them, outside the state dict), so switching back restores the exact model; a layer whose
shape the kernel cannot tile keeps ``aten`` (int8: an input width that is a multiple of 16;
int4: of 32, and an output width that is a multiple of 16). After changing the weights,
switch again to re-quantise.

``int4-vnni`` multiplies by the same int4 weights as ``int4`` with the rows (float32) as
integers: two int8 parts per group of 32 inputs (about 15 bits), 4-bit by 8-bit products on
the compiled AVX-512 VNNI kernel (:mod:`kakeya_lab.native.int4`; CPUs with AVX-512 BW and VNNI,
an output width that is a multiple of 64). It reads the packed weights at several times the
rate of PyTorch's int4 kernel, which spends its time turning each weight into a bfloat16 one,
its products are the dequantised weights' to about 1e-5 (``int4``'s bfloat16 rows: 3e-3), and
it is faster than oneDNN's float32 product for a prefill's rows too, so it serves every row
count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kakeya_lab.linear_kernels import FULL_PRECISION, KERNELS
from kakeya_lab.native import exact
from kakeya_lab.native import int4 as int4_kernel
from kakeya_lab.native.build import compiled
from kakeya_lab.native.rows import rows_product

_DTYPES = (torch.float32, torch.bfloat16)
QUANTISED = ("int8", "int4", "int4-vnni")  # the kernels that multiply by a quantised copy
# bumped whenever a kernel's implementation changes, so "auto" choices cached on disk from
# timings of the earlier implementation (or of an earlier rule for choosing) are measured
# again (part of their key)
KERNEL_REVISION = 11
INT4_GROUP = 32  # inputs per int4 scale and offset (the kernel takes 32, 64, 128 or 256)


def _recording(weight: torch.Tensor, input: torch.Tensor) -> bool:  # noqa: A002
    """Whether autograd records this product (the kernels below have no backward)."""
    return torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad)


def _aten_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input: torch.Tensor,  # noqa: A002
) -> torch.Tensor:
    """``F.linear(input, weight, bias)``: PyTorch's own product."""
    return F.linear(input, weight, bias)


def _onednn_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input: torch.Tensor,  # noqa: A002
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` through oneDNN's linear where it applies, else
    PyTorch's."""
    if (
        _recording(weight, input)
        or input.dtype != weight.dtype
        or input.device.type != "cpu"
        or input.numel() == 0
    ):
        return F.linear(input, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(input.contiguous(), weight, bias, "none", [], "")


def _split_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input: torch.Tensor,  # noqa: A002
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` as one batched product over one slice of the
    weight's output rows per thread (module docstring), where it applies, else PyTorch's."""
    parts = torch.get_num_threads()
    out_features, in_features = weight.shape
    if (
        parts < 2
        or out_features % parts
        or not weight.is_contiguous()
        or input.dtype != weight.dtype
        or input.numel() == 0
        or _recording(weight, input)
    ):
        return F.linear(input, weight, bias)
    rows = input.reshape(-1, in_features)
    out = rows_product(rows, weight)  # 1 to 16 rows: the compiled kernel, where it applies
    if out is not None:
        out = out.reshape(*input.shape[:-1], out_features)
        return out if bias is None else out + bias
    slices = weight.view(parts, out_features // parts, in_features)
    if rows.shape[0] == 1:
        # one row: slice @ row, which MKL runs as a streaming matrix-vector product, about
        # twice as fast here as row @ slice.T (with more rows this form rounds further from
        # the many-row product, past the oracle tests' 1e-4, so they keep row @ slice.T)
        out = torch.bmm(slices, rows.t().expand(parts, in_features, 1)).permute(2, 0, 1)
    else:
        out = torch.bmm(rows.expand(parts, *rows.shape), slices.transpose(1, 2)).transpose(0, 1)
    out = out.reshape(*input.shape[:-1], out_features)  # from [rows, parts, out // parts]
    return out if bias is None else out + bias


def _exact_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input: torch.Tensor,  # noqa: A002
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with the weight read from its exact integer form
    (:mod:`kakeya_lab.native.exact`: a dequantised 4- or 8-bit GGUF block's) for 1 to 16
    float32 rows, the same bits as the compiled few-row product (``split``'s, with two
    threads or more); ``split``'s product for a weight that has no such form and for other
    rows."""
    rows = input.reshape(-1, input.shape[-1]) if input.dim() else input
    if (
        input.dim()
        and 1 <= rows.shape[0] <= exact.MAX_ROWS
        and input.dtype == weight.dtype == torch.float32
        and not _recording(weight, input)
    ):
        form = exact.packed(weight)
        out = exact.exact_product(rows, form) if form is not None else None
        if out is not None:
            out = out.reshape(*input.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias
    return _split_linear(weight, bias, input)


# each full-precision kernel's product, ``(weight, bias, input) -> output``
FULL_PRECISION_PRODUCTS = {
    "aten": _aten_linear,
    "onednn": _onednn_linear,
    "split": _split_linear,
    "exact": _exact_linear,
}


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward is oneDNN's linear over its own weights."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return _onednn_linear(self.weight, self.bias, input)


class SplitLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward splits its output rows over the threads
    (:func:`_split_linear`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return _split_linear(self.weight, self.bias, input)


class ExactLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward reads its weight from the weight's exact
    integer form where it has one (:func:`_exact_linear`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return _exact_linear(self.weight, self.bias, input)


# one-token steps and verification blocks: "auto" measures each row count up to this, and the
# lean step (kakeya_lab/backends/torch_lean.py) runs blocks of up to this many tokens
FEW_ROWS = 16
QUANTISED_ROWS = 8  # up to this many rows the quantised kernels are faster than the weights


class AutoLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward runs, for each call, the full-precision
    kernel this machine measured fastest for that many rows (``_few[rows - 1]`` up to
    :data:`FEW_ROWS` rows, ``_many`` beyond; :mod:`kakeya_lab.linear_auto`)."""

    _few: tuple[str, ...]
    _many: str

    def kernel_for(self, input: torch.Tensor) -> str:  # noqa: A002
        """The kernel that runs ``input``'s rows."""
        rows = input.numel() // max(input.shape[-1], 1) if input.dim() else 1
        return self._few[rows - 1] if 1 <= rows <= FEW_ROWS else self._many

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return FULL_PRECISION_PRODUCTS[self.kernel_for(input)](self.weight, self.bias, input)


def linear_as(
    layer: nn.Linear,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input: torch.Tensor,  # noqa: A002
) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` on the full-precision kernel ``layer`` runs
    (``aten`` for a layer on no such kernel): how several layers whose weights are stacked
    (:func:`stack_rows`) run as one product on their kernel."""
    return FULL_PRECISION_PRODUCTS[product_kernel(layer, input)](weight, bias, input)


def product_kernel(layer: nn.Module, input: torch.Tensor) -> str:  # noqa: A002
    """The full-precision kernel whose product ``layer`` runs for ``input``'s rows:
    ``auto``'s choice for that many rows, ``split``, ``onednn``, or ``aten`` (any other
    layer)."""
    if isinstance(layer, AutoLinear):
        return layer.kernel_for(input)
    if isinstance(layer, SplitLinear):
        return "split"
    if isinstance(layer, ExactLinear):
        return "exact"
    if isinstance(layer, OneDNNLinear):
        return "onednn"
    return "aten"


def _stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive rows ``tensors`` are (in order, contiguous, in one
    storage), or None when they are not laid out so."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.shape[1:] != first.shape[1:]
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def _stack(layers: Sequence[nn.Linear], name: str) -> torch.Tensor:
    tensors = [getattr(layer, name) for layer in layers]
    stacked = _stacked_view(tensors)
    if stacked is not None:
        return stacked
    # a normal tensor even when called under inference mode, so the model still trains
    with torch.inference_mode(False), torch.no_grad():
        stacked = torch.cat([t.detach() for t in tensors])
        start = 0
        for layer, t in zip(layers, tensors, strict=True):
            rows = stacked[start : start + t.shape[0]]
            setattr(layer, name, nn.Parameter(rows, requires_grad=t.requires_grad))
            start += t.shape[0]
    return stacked


def stack_rows(layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of ``layers`` (same input width and dtype) as one tensor of their output
    rows in order, and their biases likewise (None when none has one): the product by it is
    their outputs side by side, in one product instead of one per layer. Each layer's
    parameter becomes a view of the stack (re-laid once: the stack is a new tensor, the old
    parameters are dropped), so the stack costs no bytes beyond the layers' own, the values
    are unchanged, and a change to either is a change to both; when the parameters already
    are such views (a second call) nothing is copied. Biases of layers of which only some
    have one are stacked as a copy (a missing one as zeros)."""
    weight = _stack(layers, "weight")
    if all(layer.bias is None for layer in layers):
        return weight, None
    if all(layer.bias is not None for layer in layers):
        return weight, _stack(layers, "bias")
    biases = [
        layer.bias.detach() if layer.bias is not None else weight.new_zeros(layer.out_features)
        for layer in layers
    ]
    return weight, torch.cat(biases)


class QuantizedLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward multiplies its rows (in :attr:`row_dtype`)
    by a quantised copy of its weight (``_packed``, built by :meth:`pack`); the result has the
    input's dtype. Subclasses name the kernel. More than :attr:`max_rows` rows at once (a
    prefill) are multiplied by the layer's own weight on oneDNN's kernel instead: PyTorch's
    quantised kernels are tuned for a few rows and take about three times as long as that
    for hundreds (``int4-vnni``'s is faster than oneDNN for any row count)."""

    _packed: tuple[torch.Tensor, ...]
    row_dtype: torch.dtype = torch.bfloat16  # the dtype :meth:`product` takes its rows in
    # more rows at once than this go to the layer's own weights (None: no row count does)
    max_rows: int | None = QUANTISED_ROWS

    @staticmethod
    def fits(layer: nn.Linear) -> bool:
        """Whether the kernel can tile ``layer``'s weight."""
        raise NotImplementedError

    @staticmethod
    def pack(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The kernel's operands for ``weight``."""
        raise NotImplementedError

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (2-D, :attr:`row_dtype`) times the quantised weight, transposed."""
        raise NotImplementedError

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        if torch.is_grad_enabled() and (self.weight.requires_grad or input.requires_grad):
            return F.linear(input, self.weight, self.bias)
        if input.device.type != "cpu" or input.numel() == 0:
            return F.linear(input, self.weight, self.bias)
        if self.max_rows is not None and input.numel() > self.max_rows * input.shape[-1]:
            if torch.backends.mkldnn.is_available():
                return _onednn_linear(self.weight, self.bias, input)
            return F.linear(input, self.weight, self.bias)
        rows = input.reshape(-1, input.shape[-1]).to(self.row_dtype).contiguous()
        out = self.product(rows).to(input.dtype)
        if self.bias is not None:
            out = out + self.bias.to(input.dtype)
        return out.reshape(*input.shape[:-1], out.shape[-1])


class Int8Linear(QuantizedLinear):
    """Weight-only int8, one bfloat16 scale per output row."""

    @staticmethod
    def fits(layer: nn.Linear) -> bool:
        return layer.in_features % 16 == 0  # other widths give wrong sums or crash

    @staticmethod
    def pack(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return quantize_int8(weight)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        weight, scale = self._packed
        return torch._weight_int8pack_mm(rows, weight, scale)


class Int4Linear(QuantizedLinear):
    """Weight-only int4, a bfloat16 scale and offset per :data:`INT4_GROUP` inputs of a row."""

    @staticmethod
    def fits(layer: nn.Linear) -> bool:
        return layer.in_features % INT4_GROUP == 0 and layer.out_features % 16 == 0

    @staticmethod
    def pack(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, scale, offset = quantize_int4(weight)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel's layout: [groups, rows, (scale, offset)]
        return packed, torch.stack([scale, offset], dim=-1).transpose(0, 1).contiguous()

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        packed, scales_and_offsets = self._packed
        return torch._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP, scales_and_offsets)


class Int4VnniLinear(QuantizedLinear):
    """``int4``'s weights (:func:`quantize_int4`) multiplied by float32 rows as two int8 parts
    per group of :data:`INT4_GROUP` inputs, on the compiled AVX-512 VNNI kernel
    (:mod:`kakeya_lab.native.int4`)."""

    row_dtype = torch.float32
    max_rows = None  # faster than oneDNN's float32 product for a prefill's rows too

    @staticmethod
    def fits(layer: nn.Linear) -> bool:
        return int4_kernel.fits(layer.out_features, layer.in_features)

    @staticmethod
    def pack(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return int4_kernel.pack(*quantize_int4(weight))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return int4_kernel.int4_product(rows, *self._packed)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of a 2-D weight: ``(q, scale)`` with ``q * scale ≈ weight``.

    The scale is rounded to bfloat16 (the kernel's dtype) before ``q`` is computed from it,
    so the rounding of the scale is not added on top of the rounding of ``q``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of a 2-D weight in groups of :data:`INT4_GROUP` inputs:
    ``(q, scale, offset)``, ``q`` in 0..15 (int32, ``[rows, inputs]``) and ``scale``,
    ``offset`` (bfloat16, ``[rows, groups]``) with ``(q - 8) * scale + offset ≈ weight``
    group by group. Scale and offset are rounded to bfloat16 before ``q`` is computed."""
    w = weight.detach().float()
    rows, width = w.shape
    groups = w.reshape(rows, width // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp_min(1e-12).to(torch.bfloat16)
    offset = (low + 8.0 * scale.float()).to(torch.bfloat16)
    q = torch.round((groups - offset.float()[..., None]) / scale.float()[..., None] + 8.0)
    return q.clamp_(0, 15).to(torch.int32).reshape(rows, width).contiguous(), scale, offset


def check_linear_kernel(kernel: str) -> None:
    """Raise ``ValueError`` unless ``kernel`` is a kernel name this PyTorch build can run."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; use one of {list(KERNELS)}")
    if kernel == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError(
            "linear kernel 'onednn' needs a PyTorch build with oneDNN (mkldnn), which this "
            "one lacks; use 'aten'"
        )
    why_not = int4_kernel.why_unavailable() if kernel == "int4-vnni" else ""
    if why_not:
        raise ValueError(
            f"linear kernel 'int4-vnni' cannot run here: {why_not}; "
            "use 'int4' (PyTorch's int4 kernel, bfloat16 rows)"
        )
    op = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}.get(kernel)
    if op and not hasattr(torch, op):
        raise ValueError(
            f"linear kernel {kernel!r} needs torch.{op}, which this PyTorch build lacks; "
            "use 'aten' or 'onednn'"
        )


_CLASSES: dict[str, type[nn.Linear]] = {
    "aten": nn.Linear,
    "onednn": OneDNNLinear,
    "split": SplitLinear,
    "exact": ExactLinear,
    "auto": AutoLinear,
    "int8": Int8Linear,
    "int4": Int4Linear,
    "int4-vnni": Int4VnniLinear,
}


def set_linear_kernel(model: nn.Module, kernel: str, *, choice: Any = None) -> int:
    """Make every ``nn.Linear`` of ``model`` run ``kernel`` (one of :data:`KERNELS`);
    return how many layers run it now.

    Only CPU layers in float32 or bfloat16 are switched away from ``aten`` (others keep it;
    for ``int8`` and ``int4`` also those whose shape the kernel cannot tile); a layer of a
    subclass of ``nn.Linear`` other than these kernels' is left alone. ``"auto"`` runs, per
    call, the full-precision kernel ``choice`` names for that many rows (its ``few`` per row
    count up to :data:`FEW_ROWS`, ``many`` beyond; kept as ``model.linear_auto_choice``):
    :func:`kakeya_lab.linear_auto.set_auto_kernel` measures it on this machine and calls
    this. Raises ``ValueError`` for an unknown kernel, or ``"auto"`` without a choice,
    before anything changes."""
    check_linear_kernel(kernel)
    target = _CLASSES[kernel]
    if kernel == "auto":
        if choice is None:
            raise ValueError(
                'set_linear_kernel(model, "auto") needs the measured choice: '
                "use kakeya_lab.linear_auto.set_auto_kernel(model)"
            )
        model.__dict__["linear_auto_choice"] = choice
    if kernel in ("split", "exact"):
        compiled()  # built (once per machine) or loaded now, not in the first forward
    switched = 0
    for module in model.modules():
        if type(module) not in _CLASSES.values():
            continue
        layer = cast(nn.Linear, module)
        for attr in ("_packed", "_few", "_many"):
            layer.__dict__.pop(attr, None)
        layer.__class__ = nn.Linear
        weight = layer.weight
        if kernel != "aten" and (weight.device.type != "cpu" or weight.dtype not in _DTYPES):
            continue
        if issubclass(target, QuantizedLinear):
            if not target.fits(layer):
                continue
            layer.__dict__["_packed"] = target.pack(weight)
        if kernel == "auto":
            layer.__dict__["_few"], layer.__dict__["_many"] = choice.few, choice.many
        layer.__class__ = target
        switched += 1
    return switched


def linear_kernel_of(model: nn.Module) -> str:
    """The kernel :func:`set_linear_kernel` last set on ``model``'s linear layers: the first
    of ``int4-vnni``, ``int4``, ``int8``, ``auto``, ``onednn``, ``exact`` and ``split`` some
    layer runs, else ``"aten"``."""
    kinds = {type(m) for m in model.modules()}
    order = ("int4-vnni", "int4", "int8", "auto", "onednn", "exact", "split")
    return next((k for k in order if _CLASSES[k] in kinds), "aten")


def kernel_description(model: nn.Module) -> str:
    """:func:`linear_kernel_of` ``model``, and for ``auto`` its choice by row count, e.g.
    ``auto (exact for 1-16 rows, aten beyond)``: what a command says it runs."""
    kernel = linear_kernel_of(model)
    choice = model.__dict__.get("linear_auto_choice")
    return f"{kernel} ({choice.summary()})" if kernel == "auto" and choice is not None else kernel


@contextmanager
def kernel_switched(model: nn.Module, kernel: str) -> Iterator[None]:
    """Run ``model``'s linear layers on the full-precision ``kernel`` inside the block and
    restore each layer's own kernel (class and packed copies, untouched) afterwards: how a
    bench times plain decoding on every kernel without reloading or re-measuring."""
    if kernel not in FULL_PRECISION:
        raise ValueError(
            f"kernel_switched takes a full-precision kernel {list(FULL_PRECISION)}, got {kernel!r}"
        )
    check_linear_kernel(kernel)
    saved = [(m, m.__class__) for m in model.modules() if type(m) in _CLASSES.values()]
    try:
        for layer, _ in saved:
            weight = cast(nn.Linear, layer).weight
            if kernel == "aten" or (weight.device.type == "cpu" and weight.dtype in _DTYPES):
                layer.__class__ = _CLASSES[kernel]
        yield
    finally:
        for layer, cls in saved:
            layer.__class__ = cls
