"""The calling thread's OpenMP worker threads, let go: :func:`release_thread_pool`.

PyTorch's CPU operations (and this package's compiled ones, :mod:`kakeya_lab.native`) run
their parallel parts on OpenMP. GNU OpenMP (the one PyTorch's Linux wheels ship) gives
every thread that runs a parallel region a pool of worker threads of its own, kept while
that thread lives. Once more of its threads are alive in the process than it has CPUs, it
stops spinning between parallel regions: a waiting worker sleeps almost at once and every
region pays a wake-up. A one-token step runs hundreds of small regions, so this is not
small: on a 2-core machine the default model's step took 34 ms when a second thread ran it
while the main thread's pool was alive, against 22 ms when either thread ran it alone
(8 sessions' batched step: 58 against 36 ms).

So a thread that hands its computing to another lets its pool go first: a session thread
submitting a step to the batcher's worker
(:class:`~kakeya_lab.backends.torch_batch.StepBatcher`), a session store's caller when a
turn's work is done, the server's main thread once the model is loaded, a server's request
threads after each request (:func:`released`). The next parallel region that thread runs
builds a new pool; building and letting go cost microseconds (measured: no difference over
a softmax of a vocabulary's logits).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: the threads end, the settings stay


@functools.cache
def _pause() -> Callable[[int], int] | None:
    """OpenMP's ``omp_pause_resource_all`` from the GNU OpenMP runtime PyTorch runs on
    (None: none is loaded, or one too old to have it). Other wheels bring their own copy
    (sentencepiece does): PyTorch's is the one in its own package, else the one loaded
    under the plain name ``libgomp.so.1``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to do
        return None
    loaded = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    home = Path(torch.__file__).parent  # its libraries: torch/lib or torch.libs beside it
    own = sorted(p for p in loaded if Path(p).parent in (home / "lib", home.parent / "torch.libs"))
    for path in (own + ["libgomp.so.1"]) if loaded else []:
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = ctypes.c_int
        return function
    return None


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP worker threads (module docstring); whether a GNU
    OpenMP runtime took the request. Harmless when the thread has none, and a no-op where
    PyTorch does not run on GNU OpenMP. Call it outside any parallel region (from Python,
    always so)."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


def released(function: Callable[P, T]) -> Callable[P, T]:
    """``function``, letting the calling thread's OpenMP pool go when it returns or raises:
    for work a server runs in a pool of threads (one request's computing in one of them,
    the next request's in another)."""

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return function(*args, **kwargs)
        finally:
            release_thread_pool()

    return call
