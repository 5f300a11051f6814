"""Returning freed heap memory to the operating system when the server goes idle.

glibc's allocator keeps memory that tensors freed in its arenas (one per thread that
allocated), to reuse it. After a burst of concurrent generations (most of all batched ones,
whose forwards allocate temporaries of a different size for every batch) that retained
memory can be far above what the server holds live, and the process's resident size (what
an operator and ``process_resident_memory_bytes`` see) swings with the load's history
rather than with its sessions. :func:`trim_heap` hands every arena's free pages back to the
system (``malloc_trim``); the server calls it when its last running generation ends, so the
cost (a few milliseconds) is paid only between bursts.

Trimming cannot reach everything: each thread arena (glibc makes one per thread that
allocates concurrently, up to eight per core) keeps the free space at its top, up to its trim
threshold, which grows to 64 MB as large blocks come and go. A server's gRPC and HTTP
worker threads would each leave such a tail resident, so the resident size grew with the
number of threads a load had touched (measured: +85 MB over 8 sessions x 85 turns, with the
live heap flat). :func:`limit_arenas` caps the arenas at two; ``kakeya-lab serve`` calls it before it loads the model.
:func:`heap_in_use_bytes` is the
allocator's own count of live allocations, the figure a leak moves and retained free memory
does not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


@functools.cache
def _glibc(name: str, argtypes: tuple[Any, ...], restype: Any) -> Callable[..., Any] | None:
    """The C library's function ``name`` with its signature; None where the C library
    lacks it (musl, macOS, a glibc before ``mallinfo2``) or none is found."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        function = getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = restype
    return function


M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)
SERVER_ARENAS = 2  # the main thread's arena and one that every worker thread shares


def limit_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Cap the allocator's arenas (``mallopt(M_ARENA_MAX, arenas)``) for the threads this
    process starts from now on; True if the C library took it (False elsewhere)."""
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return bool(mallopt(M_ARENA_MAX, arenas)) if mallopt is not None else False


def trim_heap() -> bool:
    """Return the allocator's free memory to the system; True if any was released
    (False, and nothing done, where the C library has no ``malloc_trim``)."""
    trim = _glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    return bool(trim(0)) if trim is not None else False


def heap_in_use_bytes() -> float:
    """Bytes the C allocator has handed out and not had back, over all its arenas and its
    mmapped blocks (``uordblks + hblkhd``): the process's live heap, which tensors, kernel
    caches and Python objects all draw on. Unlike the resident size it does not count free
    memory the allocator keeps for reuse. NaN where the C library has no ``mallinfo2``."""
    info = _glibc("mallinfo2", (), _MallInfo2)
    if info is None:
        return float("nan")
    m = info()
    return float(m.uordblks + m.hblkhd)
