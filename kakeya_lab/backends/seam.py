"""The backend seam: what the :class:`~kakeya_lab.verifier.Verifier` needs from a model
runtime.

A backend owns one model and one sink-window cache for one sequence. It feeds blocks of
token ids at the next positions, keeps them provisional until :meth:`Backend.commit`
(eviction happens there and nowhere else) or drops them with :meth:`Backend.rollback`, and
reports the cache's state. Logits always come back as float32 ``torch`` tensors, so
everything above the verifier (sessions, proposers, speculative decoding, benches) is the
same code on every backend. Where entries live is decided by the backend-neutral
:class:`~kakeya_lab.backends.plan.SlotPlan`; a backend does the tensor work.

Backends are found by :mod:`kakeya_lab.backends.registry` (``make_backend``, ``name_of``).
Imports no tensor runtime.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kakeya_lab.backends import registry
from kakeya_lab.backends.config import SinkWindowConfig

if TYPE_CHECKING:
    import torch

    from kakeya_lab.tree import DraftTree


@dataclass
class Forward:
    """What one forward returns: ``logits`` float32 ``[rows, vocab]`` (the last row only,
    or one row per token) and, when asked for, the final hidden states (the lm_head's input)
    float32 ``[len(token_ids), hidden]`` (every row)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@runtime_checkable
class Backend(Protocol):
    """One model + one sink-window cache for one sequence.

    ``forward(ids, all_rows=..., hidden=...)`` appends ``ids`` at positions
    ``next_position, next_position + 1, ...`` as provisional entries; if it raises, the
    backend is as it was before the call (earlier provisional entries included).
    ``commit(n)`` keeps the first ``n`` provisional entries and evicts; ``rollback()``
    drops them all. With ``tree`` (a :class:`~kakeya_lab.tree.DraftTree` of
    ``token_ids``, no provisional entries open) token ``i`` sits at ``next_position +
    depth(i)`` and sees, among the block, only its ancestors; ``select(path)`` then
    keeps a root-to-node path as the first provisional entries (before ``commit``).
    ``hidden_states``: whether ``forward(..., hidden=True)`` is available.
    """

    name: str
    config: SinkWindowConfig
    vocab_size: int
    hidden_states: bool

    def forward(
        self,
        token_ids: Sequence[int],
        *,
        all_rows: bool,
        hidden: bool = False,
        tree: DraftTree | None = None,
    ) -> Forward: ...

    def select(self, indices: Sequence[int]) -> None: ...

    def commit(self, n: int) -> None: ...

    def rollback(self) -> None: ...

    def reset(self) -> None: ...

    @property
    def cache_len(self) -> int: ...

    @property
    def pending_len(self) -> int: ...

    @property
    def next_position(self) -> int: ...

    def cached_positions(self) -> list[int]: ...

    def kv_live_bytes(self) -> int: ...

    def kv_budget_bytes(self) -> int | None: ...

    @property
    def cache(self) -> Any:
        """The backend's cache object (its type depends on the backend)."""
        ...


class CacheBackend:
    """The cache verbs every backend answers by asking its sink-window cache (``self.cache``);
    a backend adds ``forward``."""

    cache: Any
    hidden_states = False

    def commit(self, n: int) -> None:
        self.cache.commit(n)

    def select(self, indices: Sequence[int]) -> None:
        self.cache.select(indices)

    def rollback(self) -> None:
        self.cache.rollback()

    def reset(self) -> None:
        self.cache.reset()

    @property
    def cache_len(self) -> int:
        return self.cache.cache_len

    @property
    def pending_len(self) -> int:
        return self.cache.pending_len

    @property
    def next_position(self) -> int:
        return self.cache.next_position

    def cached_positions(self) -> list[int]:
        return self.cache.cached_positions()

    def kv_live_bytes(self) -> int:
        return self.cache.kv_live_bytes()

    def kv_budget_bytes(self) -> int | None:
        return self.cache.kv_budget_bytes()


def proposer_backend(proposer: Any) -> str | None:
    """The backend a proposer computes on (``None``: no model, e.g. n-gram lookup).

    Read from ``proposer.backend`` when it says; else from the verifier a draft-model
    proposer drafts with, or the drafter module a hidden-state proposer runs."""
    named = getattr(proposer, "backend", None)
    if isinstance(named, str):
        return named
    draft_verifier = getattr(proposer, "verifier", None)
    if draft_verifier is not None and isinstance(
        getattr(draft_verifier, "backend_name", None), str
    ):
        return draft_verifier.backend_name
    drafter = getattr(proposer, "drafter", None)
    if drafter is not None:
        return registry.name_of(drafter)
    return None


def check_same_backend(verifier_backend: str, proposer: Any) -> None:
    """Raise ValueError if ``proposer`` computes on another backend than the verifier."""
    theirs = proposer_backend(proposer)
    if theirs is not None and theirs != verifier_backend:
        raise ValueError(
            f"the proposer {getattr(proposer, 'name', type(proposer).__name__)!r} runs on {theirs} but the "
            f"verifier on {verifier_backend}: load the draft model (or drafter) on the same backend"
        )


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a SIGINT (``KeyboardInterrupt``, a notebook's Stop button) until the block has
    run, then raise it: a commit cannot be left half done. A no-op outside the main
    thread, where Python never delivers ``KeyboardInterrupt`` asynchronously."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, FrameType | None]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(*received[0])
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
