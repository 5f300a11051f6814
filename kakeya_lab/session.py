"""Session runtime: many conversations, one sink-window cache each.

A session appends only the *new* tokens of each turn, so a turn's prefill cost depends on
the new message and not on the history. :meth:`SessionStore.generate` is a generator of
events (DESIGN.md "Session runtime"): at most one :class:`HistoryTruncated` per call,
one :class:`Token` per emitted token, and a final :class:`Done`.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from transformers import PreTrainedModel

from kakeya_lab.cache import SinkWindowConfig
from kakeya_lab.sampling import check_sampling
from kakeya_lab.speculative import (
    DecodeState,
    SpeculativeStep,
    plain_decode,
    settle,
    speculative_decode,
)
from kakeya_lab.verifier import Verifier

if TYPE_CHECKING:
    from kakeya_lab.proposers import Proposer

CapacityPolicy = Literal["reject", "evict_lru"]


class SessionError(Exception):
    """Base class of session-store errors."""


class UnknownSession(SessionError, KeyError):
    """The id names no open session (never created, closed, or evicted)."""

    def __str__(self) -> str:  # KeyError quotes its argument; say it plainly
        return str(self.args[0])


class CapacityExceeded(SessionError):
    """``create`` under the ``reject`` policy with every slot in use."""


@dataclass(frozen=True)
class HistoryTruncated:
    """The cache has started dropping history: ``dropped`` tokens are no longer attended."""

    dropped: int


@dataclass(frozen=True)
class Token:
    id: int


@dataclass(frozen=True)
class Done:
    """End of a ``generate`` call. ``stop_reason`` is ``"eos"``, ``"stop"`` or ``"max_tokens"``."""

    stop_reason: str
    counts: dict
    timings: dict


Event = HistoryTruncated | Token | SpeculativeStep | Done


@dataclass(frozen=True)
class AppendResult:
    appended: int
    dropped: int
    latency_s: float
    history_len: int
    cache_len: int


@dataclass(frozen=True)
class SessionInfo:
    id: str
    history_len: int
    cache_len: int
    kv_live_bytes: int
    turns: int
    generated_tokens: int
    created_s: float
    last_used_s: float
    config: dict
    speculative: dict


@dataclass
class _Session:
    id: str
    verifier: Verifier
    created_s: float
    last_used_s: float
    next_logits: torch.Tensor | None = None
    turns: int = 0
    generated_tokens: int = 0
    stats: dict = field(default_factory=dict)


def model_eos_ids(model: PreTrainedModel) -> frozenset[int]:
    """The end-of-sequence ids the model's generation config (or config) declares."""
    eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else list(eos or []))


class SessionStore:
    """Owns sessions over one model; each session has its own verifier and cache.

    ``capacity`` bounds open sessions; ``policy`` says what ``create`` does when full:
    ``"reject"`` raises :class:`CapacityExceeded`, ``"evict_lru"`` closes the least
    recently used session. Sessions idle longer than ``idle_ttl_s`` are closed at the
    next call into the store. ``check_invariants`` verifies the cache mirror after every
    mutation (cheap; on by default).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: SinkWindowConfig,
        *,
        capacity: int = 8,
        policy: CapacityPolicy = "reject",
        idle_ttl_s: float | None = None,
        eos_token_ids: Sequence[int] | None = None,
        prefill_chunk: int = 512,
        check_invariants: bool = True,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if policy not in ("reject", "evict_lru"):
            raise ValueError(f"policy must be 'reject' or 'evict_lru', got {policy!r}")
        if idle_ttl_s is not None and idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be > 0 or None, got {idle_ttl_s}")
        self.model = model
        self.config = config
        self.capacity = capacity
        self.policy = policy
        self.idle_ttl_s = idle_ttl_s
        self.prefill_chunk = prefill_chunk
        self.check_invariants = check_invariants
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else model_eos_ids(model))
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._lock = threading.RLock()
        self.evicted: list[tuple[str, str]] = []  # (id, reason), most recent last

    # --------------------------------------------------------------- lifecycle
    def create(self) -> str:
        """Open a session and return its server-issued id."""
        with self._lock:
            self._expire_idle()
            if len(self._sessions) >= self.capacity:
                if self.policy == "reject":
                    raise CapacityExceeded(
                        f"all {self.capacity} session slots are in use (policy 'reject'); close one first"
                    )
                victim, _ = next(iter(self._sessions.items()))
                self._drop(victim, "evicted: least recently used")
            sid = secrets.token_hex(8)
            now = time.monotonic()
            verifier = Verifier(self.model, self.config, prefill_chunk=self.prefill_chunk)
            self._sessions[sid] = _Session(sid, verifier, created_s=now, last_used_s=now)
            return sid

    def close(self, session_id: str) -> None:
        """Close a session and free its cache. Unknown or already closed ids raise."""
        with self._lock:
            self._get(session_id)
            self._drop(session_id, "closed")

    def __len__(self) -> int:
        with self._lock:
            self._expire_idle()
            return len(self._sessions)

    def ids(self) -> list[str]:
        with self._lock:
            self._expire_idle()
            return list(self._sessions)

    def _drop(self, session_id: str, reason: str) -> None:
        session = self._sessions.pop(session_id)
        session.verifier.cache.reset()
        self.evicted.append((session_id, reason))
        del self.evicted[:-100]

    def _expire_idle(self) -> None:
        if self.idle_ttl_s is None:
            return
        now = time.monotonic()
        for sid in [s.id for s in self._sessions.values() if now - s.last_used_s > self.idle_ttl_s]:
            self._drop(sid, f"evicted: idle longer than {self.idle_ttl_s}s")

    def _get(self, session_id: str) -> _Session:
        self._expire_idle()
        session = self._sessions.get(session_id)
        if session is None:
            reason = next((r for sid, r in reversed(self.evicted) if sid == session_id), None)
            detail = f" ({reason})" if reason else ""
            raise UnknownSession(f"unknown session id {session_id!r}{detail}")
        return session

    def _touch(self, session: _Session) -> None:
        session.last_used_s = time.monotonic()
        self._sessions.move_to_end(session.id)

    # ---------------------------------------------------------------- mutation
    def append(self, session_id: str, token_ids: Sequence[int] | torch.Tensor) -> AppendResult:
        """Append (commit) ``token_ids`` to the session; nothing changes if they are invalid."""
        with self._lock:
            session = self._get(session_id)
            verifier = session.verifier
            history_before = verifier.history_len
            dropped_before = verifier.history_len - verifier.cache_len
            t0 = time.perf_counter()
            session.next_logits = verifier.append(token_ids)
            latency = time.perf_counter() - t0
            session.turns += 1
            self._touch(session)
            self._check(session, expected_history=None)
            return AppendResult(
                appended=verifier.history_len - history_before,
                dropped=(verifier.history_len - verifier.cache_len) - dropped_before,
                latency_s=latency,
                history_len=verifier.history_len,
                cache_len=verifier.cache_len,
            )

    def generate(
        self,
        session_id: str,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        proposer: Proposer | None = None,
        k: int = 4,
        adaptive_k: bool = False,
    ) -> Iterator[Event]:
        """Generate up to ``max_new_tokens`` tokens; yields events as they happen.

        ``proposer=None`` is plain decoding; otherwise speculative decoding with drafts of
        ``k`` tokens (greedy output is identical to plain decoding). Every emitted token is
        committed to the session (EOS included), also if the caller stops iterating early.
        Arguments are checked before the first event.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_sampling(temperature, top_k, top_p)
        if proposer is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        with self._lock:
            session = self._get(session_id)
            if session.next_logits is None:
                raise SessionError(f"session {session_id!r} is empty: append a prompt before generate")
        return self._generate(
            session, max_new_tokens, temperature, seed, top_k, top_p, stop_token_ids,
            proposer, k, adaptive_k,
        )

    def _generate(
        self, session, max_new_tokens, temperature, seed, top_k, top_p, stop_token_ids,
        proposer, k, adaptive_k,
    ):
        generator = None
        if temperature > 0:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        stops = self.eos_token_ids | frozenset(stop_token_ids or ())
        verifier = session.verifier
        truncated_reported = verifier.history_len > verifier.cache_len
        start_history = verifier.history_len
        state = DecodeState(next_logits=session.next_logits)
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if proposer is None:
            stream = plain_decode(
                verifier, state, max_new_tokens=max_new_tokens, stop_token_ids=stops, **sampling
            )
        else:
            stream = speculative_decode(
                verifier, state, proposer, max_new_tokens=max_new_tokens, k=k,
                stop_token_ids=stops, adaptive=adaptive_k, **sampling,
            )
        t_start = time.perf_counter()
        first_token_s = None
        last = None
        with self._lock:
            try:
                for item in stream:
                    if isinstance(item, SpeculativeStep):
                        session.stats["steps"] = session.stats.get("steps", 0) + 1
                        session.stats["proposed"] = session.stats.get("proposed", 0) + item.proposed
                        session.stats["accepted"] = session.stats.get("accepted", 0) + item.accepted
                        yield item
                        continue
                    last = item
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - t_start
                    self._touch(session)
                    dropped = verifier.history_len - verifier.cache_len
                    if dropped > 0 and not truncated_reported:
                        truncated_reported = True
                        yield HistoryTruncated(dropped=dropped)
                    yield Token(id=item)
            finally:
                settle(verifier, state)
                session.next_logits = state.next_logits
                session.generated_tokens += state.emitted
                self._check(session, expected_history=start_history + state.emitted)
            if proposer is not None:
                session.stats["emitted"] = session.stats.get("emitted", 0) + state.emitted
                session.stats["forwards"] = session.stats.get("forwards", 0) + state.verifier_forwards
            total = time.perf_counter() - t_start
            stop_reason = state.stop_reason
            if stop_reason == "stop" and last in self.eos_token_ids:
                stop_reason = "eos"
            yield Done(
                stop_reason=stop_reason,
                counts={
                    "generated_tokens": state.emitted,
                    "verifier_forwards": state.verifier_forwards,
                    "tau": state.emitted / state.verifier_forwards if state.verifier_forwards else None,
                    "proposed": sum(s.proposed for s in state.steps),
                    "accepted": sum(s.accepted for s in state.steps),
                    "history_len": verifier.history_len,
                    "cache_len": verifier.cache_len,
                    "kv_live_bytes": verifier.kv_live_bytes,
                },
                timings={
                    "total_s": total,
                    "first_token_s": first_token_s,
                    "verifier_s": state.verifier_s,
                    "proposer_s": sum(s.proposer_s for s in state.steps),
                    "tokens_per_s": state.emitted / total if total > 0 else None,
                },
            )

    # ------------------------------------------------------------------- query
    def info(self, session_id: str) -> SessionInfo:
        with self._lock:
            s = self._get(session_id)
            v = s.verifier
            return SessionInfo(
                id=s.id,
                history_len=v.history_len,
                cache_len=v.cache_len,
                kv_live_bytes=v.kv_live_bytes,
                turns=s.turns,
                generated_tokens=s.generated_tokens,
                created_s=s.created_s,
                last_used_s=s.last_used_s,
                config=self.config.to_dict(),
                speculative=_speculative_summary(s.stats),
            )

    def verifier(self, session_id: str) -> Verifier:
        """The session's verifier (read its state; mutate only through the store)."""
        with self._lock:
            return self._get(session_id).verifier

    # -------------------------------------------------------------- invariants
    def _check(self, session: _Session, expected_history: int | None) -> None:
        if not self.check_invariants:
            return
        v = session.verifier
        positions = v.cached_positions()
        history = v.history_len
        if expected_history is not None and history != expected_history:
            raise AssertionError(f"history length {history}, expected {expected_history}")
        if len(positions) != v.cache_len or len(set(positions)) != len(positions):
            raise AssertionError("cache slots do not mirror distinct positions")
        cfg = self.config
        if cfg.window is None:
            expected = list(range(history))
        else:
            expected = sorted(set(range(min(cfg.sink, history))) | set(range(max(0, history - cfg.window), history)))
        if positions != expected:
            raise AssertionError(f"cached positions {positions[:8]}... differ from the sink-window rule")
        if history and v.kv_live_bytes <= 0:
            raise AssertionError("kv_live_bytes is 0 after an append")


def _speculative_summary(stats: dict) -> dict:
    """Cumulative speculative figures of a session (DESIGN.md "Metrics")."""
    steps, proposed, accepted = stats.get("steps", 0), stats.get("proposed", 0), stats.get("accepted", 0)
    return {
        "steps": steps,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "tau": stats["emitted"] / stats["forwards"] if stats.get("forwards") else None,
    }
