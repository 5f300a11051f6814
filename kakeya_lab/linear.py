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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("aten", "onednn")
_DTYPES = (torch.float32, torch.bfloat16)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose inference forward is oneDNN's linear over its own weights."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        if torch.is_grad_enabled() and (self.weight.requires_grad or input.requires_grad):
            return F.linear(input, self.weight, self.bias)
        if input.dtype != self.weight.dtype or input.device.type != "cpu" or input.numel() == 0:
            return F.linear(input, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            input.contiguous(), self.weight, self.bias, "none", [], ""
        )


def check_linear_kernel(kernel: str) -> None:
    """Raise ``ValueError`` unless ``kernel`` is a kernel name this PyTorch build can run."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; use one of {list(KERNELS)}")
    if kernel == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError(
            "linear kernel 'onednn' needs a PyTorch build with oneDNN (mkldnn), which this "
            "one lacks; use 'aten'"
        )


def set_linear_kernel(model: nn.Module, kernel: str) -> int:
    """Make every ``nn.Linear`` of ``model`` run ``kernel`` (``"aten"`` or ``"onednn"``);
    return how many layers were switched.

    Only CPU layers in float32 or bfloat16 are switched to ``onednn`` (others keep
    ``aten``); a layer of a subclass of ``nn.Linear`` other than :class:`OneDNNLinear` is
    left alone. Raises ``ValueError`` for an unknown kernel, before anything changes."""
    check_linear_kernel(kernel)
    switched = 0
    for module in model.modules():
        if type(module) not in (nn.Linear, OneDNNLinear):
            continue
        if kernel == "onednn":
            weight = module.weight
            if weight.device.type != "cpu" or weight.dtype not in _DTYPES:
                continue
            module.__class__ = OneDNNLinear
        else:
            module.__class__ = nn.Linear
        switched += 1
    return switched


def linear_kernel_of(model: nn.Module) -> str:
    """``"onednn"`` if any linear layer of ``model`` runs oneDNN's kernel, else ``"aten"``."""
    return "onednn" if any(type(m) is OneDNNLinear for m in model.modules()) else "aten"
