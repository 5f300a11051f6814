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

It is compiled with PyTorch's extension builder (a C++ compiler and ninja) the first time a
process asks for it on a CPU with AVX-512, about 30 seconds, into the model store
(``$KAKEYA_LAB_HOME/kernels/build/``, one folder per source, torch version and CPU), and
loaded from there afterwards. Where it cannot be built (no AVX-512, no compiler or ninja,
a failed build) :func:`rows_kernel` returns None, :func:`why_unavailable` says why, and the
``split`` kernel runs its PyTorch products instead (the same numbers to float rounding).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from kakeya_lab.results import cpu_identity

MAX_ROWS = 8  # the most rows the compiled product takes (more: load-bound, slower than MKL)
SOURCE = Path(__file__).with_name("rows.cpp")
FLAGS = ["-O3", "-mavx512f", "-mavx512dq", "-mfma"]

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: tuple[Any, str] | None = None  # (module or None, why not) once tried


def _build() -> tuple[Any, str]:
    if "avx512f" not in cpu_identity()["cpu_flags"]:
        return None, "the CPU has no AVX-512"
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        return None, f"no {' or '.join(missing)} on PATH"
    from torch.utils.cpp_extension import load

    from kakeya_lab.models.store import store_home

    source = SOURCE.read_text()
    identity = cpu_identity()
    digest = hashlib.sha256(
        "\n".join([source, torch.__version__, identity["cpu"], " ".join(FLAGS)]).encode()
    ).hexdigest()[:16]
    folder = store_home() / "kernels" / "build" / f"rows-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    _log.info("building the few-row product kernel into %s (once per machine)", folder)
    try:
        module = load(
            name=f"kakeya_rows_{digest}",
            sources=[str(SOURCE)],
            extra_cflags=[*FLAGS, "-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # a compiler error, a missing header: run without it
        return None, f"the build failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
    return module, ""


def rows_kernel() -> Any | None:
    """The compiled module (built or loaded on the first call of the process), or None
    when it cannot be built here (:func:`why_unavailable`)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
    return _loaded[0]


def why_unavailable() -> str:
    """Why :func:`rows_kernel` is None ("" when it is not, or was not tried yet)."""
    return "" if _loaded is None else _loaded[1]


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
    module = rows_kernel()
    if module is None or not fits(rows, weight):
        return None
    return module.rows_product(rows.contiguous(), weight)
