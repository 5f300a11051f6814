"""Returning freed heap memory to the operating system when the server goes idle.

glibc's allocator keeps memory that tensors freed in its arenas (one per thread that
allocated), to reuse it. After a burst of concurrent generations (most of all batched ones,
whose forwards allocate temporaries of a different size for every batch) that retained
memory can be far above what the server holds live, and the process's resident size (what
an operator and ``process_resident_memory_bytes`` see) swings with the load's history
rather than with its sessions. :func:`trim_heap` hands every arena's free pages back to the
system (``malloc_trim``); the server calls it when its last running generation ends, so the
cost (a few milliseconds) is paid only between bursts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None on another C library or platform)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim with
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return the allocator's free memory to the system; True if any was released
    (False, and nothing done, where the C library has no ``malloc_trim``)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
