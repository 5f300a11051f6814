"""A compiled product of a few rows by a weight matrix: :func:`rows_product`.

A one-token step multiplies one row by every weight matrix, and a verification block or a
batch of a few sessions' steps 2 to 16 rows. MKL's products read the weights at the full
bandwidth only for one row (``split``'s ``slice @ row``); for two rows ``split``'s batched
product takes about twice as long as for one, and a block of 9 (a draft of 8 and the token
before it) about three times. ``rows.cpp`` reads each weight row once for all the rows
(AVX-512, or AVX2 with FMA where the CPU lacks AVX-512; the output rows split over
PyTorch's threads; one or two rows as one stream of weight rows per thread, more with the
next weight rows prefetched while a block computes, more than 8 (4 with AVX2's registers)
as passes over each block of weight rows while it is in L1): on this kind
of machine (2 cores, Zen 4), over the default model's weights, one row reads them in about
1.1 times a plain read of their bytes (MKL's matrix-vector product: about 1.3 times), 2 to 8
rows cost about what one does, 12 rows 1.5 times, 16 rows 1.9 times. It sums each
output in a vector's lanes (16, or AVX2's 8), at least as close to the exact sum as MKL's,
in the same order whatever the number of rows, so a row's output does not depend on the rows
that come with it (a session batched with others computes what it computes alone).
``split`` runs it for 1 to :data:`MAX_ROWS` rows; more rows run on its batched product
(beyond 16 the kernel, whose accumulators no longer fit the registers, is the slower).

It is compiled with the other kernels of this folder (:mod:`kakeya_lab.native.build`);
where they cannot be built :func:`rows_product` returns None and the ``split`` kernel runs
its PyTorch products instead (the same numbers to float rounding)."""

from __future__ import annotations

import torch

from kakeya_lab.native.build import compiled

MAX_ROWS = 16  # the most rows the compiled product takes (more: slower than MKL)


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
