"""Which BLAS the MLX CPU backend calls on Linux.

The Linux ``mlx[cpu]`` wheel ships the reference (netlib) BLAS. Its matrix products run
at about 3.5 GFLOP/s on one core of this machine kind, so MLX prefill was 14x slower
than torch's for the same model. If an optimized system BLAS (Debian's
``libopenblas0-pthread``) is installed, loading it with ``RTLD_GLOBAL`` before ``mlx`` is
first imported puts it ahead of the bundled library in the dynamic linker's search order,
so MLX's ``cblas_*`` calls go to it. A 32x576 by 576x576 product then runs at about 80
GFLOP/s. The arithmetic is the same fp32 GEMM; only the summation order differs, which the
MLX oracle tests' tolerances already allow for.

Importing :mod:`kakeya_lab` calls :func:`prefer_system_blas_before_mlx`, which runs
:func:`prefer_system_blas` just before the first ``import mlx`` of the process (an import
hook), so the package import itself stays free of torch and mlx. Set
``KAKEYA_MLX_BLAS=bundled`` to keep the wheel's own library. :func:`mlx_blas` says which
one this process uses, and MLX model descriptions record it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.abc
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

_SYSTEM_BLAS_NAMES = ("openblas",)
_chosen: str | None = None


def prefer_system_blas() -> str | None:
    """Load an optimized system BLAS globally on Linux, before ``mlx`` is imported.

    Returns the library's file name, or None when nothing was loaded: not Linux,
    ``KAKEYA_MLX_BLAS=bundled``, ``mlx`` already imported (too late to matter), or no
    system BLAS installed. Calling it again returns the first answer.
    """
    global _chosen
    if _chosen is not None:
        return _chosen or None
    _chosen = ""
    if not sys.platform.startswith("linux") or os.environ.get("KAKEYA_MLX_BLAS") == "bundled":
        return None
    if "mlx.core" in sys.modules:
        return None
    # torch first: Python loads extension modules with RTLD_NOW, so torch's libraries bind
    # their own BLAS now and the global library loaded below serves MLX only. Loaded before
    # torch, it also took torch's calls: a torch decode step ran ~1.6x slower.
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    for name in _SYSTEM_BLAS_NAMES:
        path = ctypes.util.find_library(name)
        if path is None:
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _chosen = path
        return path
    return None


class _BeforeMlx(importlib.abc.MetaPathFinder):
    """Calls :func:`prefer_system_blas` when ``mlx`` is first imported, then steps aside
    (it finds nothing itself: the regular finders import mlx)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname == "mlx":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            prefer_system_blas()
        return None


def prefer_system_blas_before_mlx() -> None:
    """Arrange for :func:`prefer_system_blas` to run just before ``mlx`` is first imported
    (at once if ``mlx`` is already imported: then it is too late and does nothing). Cheap:
    imports neither torch nor mlx now. Calling it again changes nothing."""
    if "mlx" in sys.modules:
        prefer_system_blas()
        return
    if not any(isinstance(finder, _BeforeMlx) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMlx())


def mlx_blas() -> str:
    """The BLAS MLX's CPU backend uses in this process: a system library's name, or
    ``"bundled"`` for the wheel's reference BLAS (and on macOS, where MLX uses Accelerate
    or Metal and this module does nothing)."""
    if sys.platform == "darwin":
        return "accelerate"
    return _chosen or "bundled"
