"""One session's record in the store's table (internal to :mod:`kakeya_lab.session`).

The store creates and drops records; :class:`~kakeya_lab.session.stream.GenerationStream`
reads ``lock``, ``closed_reason`` and ``computing``. Fields change only under ``lock``
(``claimed`` and the table order under the store's lock).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.verifier import Verifier

if TYPE_CHECKING:
    from kakeya_lab.session.stream import GenerationStream
    from kakeya_lab.speculative import Decoder


@dataclass(eq=False)
class SessionState:
    """A session: its verifier and next-token logits, counters, and stream bookkeeping."""

    id: str
    verifier: Verifier
    created_s: float
    last_used_s: float  # the last append or generation (what SessionInfo reports)
    metadata: object = None  # what the creator attached (e.g. the server's per-session state)
    last_seen_s: float = 0.0  # the last call of any kind, reads too: idle TTL and LRU order
    next_logits: torch.Tensor | None = None
    turns: int = 0
    generated_tokens: int = 0
    stats: dict = field(default_factory=dict)  # cumulative speculative figures
    lock: threading.RLock = field(default_factory=threading.RLock)
    stream: weakref.ref | None = None  # the open GenerationStream, if any
    decoder: Decoder | None = None  # the last generation, until its result is taken over
    closed_reason: str | None = None  # set once the store has dropped the session
    computing: int = 0  # > 0 while a stream computes an event (never expired then)
    claimed: bool = False  # held by a caller (SessionStore.claim): not evicted, not re-claimed

    def open_stream(self) -> GenerationStream | None:
        return self.stream() if self.stream is not None else None

    def check_cache_mirror(self, config: SinkWindowConfig, expected_history: int | None) -> None:
        """Raise ``AssertionError`` unless the cache holds exactly the positions the
        sink-window rule keeps (and ``expected_history`` tokens of history, if given)."""
        v = self.verifier
        positions = v.cached_positions()
        history = v.history_len
        if expected_history is not None and history != expected_history:
            raise AssertionError(f"history length {history}, expected {expected_history}")
        if len(positions) != v.cache_len or len(set(positions)) != len(positions):
            raise AssertionError("cache slots do not mirror distinct positions")
        cfg = config
        if cfg.window is None:
            expected = list(range(history))
        else:
            expected = sorted(
                set(range(min(cfg.sink, history)))
                | set(range(max(0, history - cfg.window), history))
            )
        if positions != expected:
            raise AssertionError(
                f"cached positions {positions[:8]}... differ from the sink-window rule"
            )
        if history and v.kv_live_bytes <= 0:
            raise AssertionError("kv_live_bytes is 0 after an append")
