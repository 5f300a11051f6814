"""A compiled product of a few rows by a weight matrix: :func:`rows_product`.

A verification block and a batch of a few sessions' steps multiply 2 to 8 rows by every
weight matrix. MKL's products read the weights at the full bandwidth only for one row
(``split``'s ``slice @ row``); for two rows ``split``'s batched product takes about twice
as long as for one, so a block of a few tokens costs about twice a one-token step.
``rows.cpp`` reads each weight row once for all the rows (AVX-512, the output rows split over
PyTorch's threads): two rows cost about what one does, eight about twice, and it sums each
output in 16 lanes, at least as close to the exact sum as MKL's. ``split`` runs it for 2 to
:data:`MAX_ROWS` rows; one row stays on MKL's matrix-vector product (as fast, and cheaper to
call), more rows on its batched product (from about 16 rows the kernel, bound by loading
the rows, is the slower).

It is compiled with the other kernels of this folder (:mod:`kakeya_lab.native.build`);
where they cannot be built :func:`rows_product` returns None and the ``split`` kernel runs
its PyTorch products instead (the same numbers to float rounding).
"""

from __future__ import annotations

import torch

from kakeya_lab.native.build import compiled

MAX_ROWS = 8  # the most rows the compiled product takes (more: load-bound, slower than MKL)


def fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rows_product` takes these: float32 on the CPU, 1 to
    :data:`MAX_ROWS` rows, an input width that is a multiple of 16, a contiguous weight."""
    return (
        rows.dtype == weight.dtype == torch.float32
        and rows.device.type == weight.device.type == "cpu"
        and 1 <= rows.shape[0] <= MAX_ROWS
        and weight.shape[1] % 16 == 0
        and weight.is_contiguous()
    )


def rows_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``rows @ weight.T`` (``[n, in]`` by ``[out, in]``) on the compiled kernel, or None
    when it is unavailable or does not take these (:func:`fits`); no autograd."""
    module = compiled()
    if module is None or not fits(rows, weight):
        return None
    return module.rows_product(rows.contiguous(), weight)
