"""The session store: one table of sessions over one model, one sink-window cache each.

A session appends only the *new* tokens of each turn, so a turn's prefill cost depends on
the new message and not on the history. :meth:`SessionStore.generate` returns a
:class:`GenerationStream` of events: at most one :class:`HistoryTruncated` per call, one
:class:`Token` per delivered token, a :class:`SpeculativeStep` per verifier forward in
speculative mode, and a final :class:`Done`.

Safety rules (docs/design.md, "Sessions"):

* A stream commits exactly the tokens it yielded as :class:`Token` events. A consumer
  that stops early (``break``, ``close()``, garbage collection) leaves no undelivered
  token behind: the rest of the step is rolled back (verifier and proposer), and the
  session's next-token logits follow the last delivered token.
* One generation at a time per session: ``generate``/``append``/``probe`` on a session
  whose stream is open raise :class:`SessionBusy`.
* Locks: each session has its own lock, held while a stream computes its next event and
  released before the event is handed out (never held across a ``yield``). The store's
  lock guards only the session table. A paused stream blocks nobody.
* Close, ``evict_lru`` policy eviction or idle expiry of a streaming session end its
  stream with :class:`SessionClosed` (naming the reason) at the consumer's next ``next()``;
  :meth:`SessionStore.evict_lru` (what the server uses) picks only idle sessions
  (unclaimed, no open stream), so a served session is never evicted mid-stream.
* Idle TTL: a session is idle from its last store call or last event handed out. A stream
  that is computing an event is never expired (so never mid-token); a stream whose
  consumer has not asked for an event for ``idle_ttl_s`` is idle like any other session
  (an abandoned, never-closed stream cannot pin a session forever).
* ``append`` is all-or-nothing at the session level: counters, next-token logits, turn
  count and last-used time change only when the verifier's append succeeds.
* Interrupts (docs/design.md, "Interrupts"): a ``KeyboardInterrupt`` (Ctrl-C, a notebook's
  Stop button) or a proposer's error anywhere in a ``generate`` leaves the session's
  history equal to the prompt plus exactly the tokens ``next()`` returned, with matching
  cache and next-token logits, and no later call wedged. The stream's hand-off protocol
  decides which tokens were received (:mod:`kakeya_lab.session.stream`); every commit and
  the bookkeeping that goes with it run with SIGINT deferred; and the generation's result
  is taken over by the session (:meth:`SessionStore._reconcile`, idempotent) in the
  stream's cleanup or, if that was cut short, by the session's next call.
* The table is the only one: callers that share it (the server) attach their per-session
  state as ``metadata`` at :meth:`SessionStore.create`, hold a session for a request with
  :meth:`SessionStore.claim` / :meth:`SessionStore.release`, and evict by the store's
  least-recently-used order (:meth:`SessionStore.evict_lru`).
"""

from __future__ import annotations

import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import torch
from transformers import PreTrainedModel

# the module, not its names: speculative imports the events of this package, so under the
# other import order Decoder is not defined yet when this module loads
from kakeya_lab import inputs, speculative
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.registry import vocab_size_of
from kakeya_lab.backends.seam import interrupts_deferred
from kakeya_lab.backends.thread_pool import release_thread_pool
from kakeya_lab.inputs import InputTypeError
from kakeya_lab.proposers import check_proposer
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.session.errors import (
    CapacityExceeded,
    SessionBusy,
    SessionError,
    SessionInUse,
    UnknownSession,
)
from kakeya_lab.session.events import (
    Done,
    Event,
    GenerationCounts,
    GenerationTimings,
    HistoryTruncated,
    Token,
)
from kakeya_lab.session.records import (
    AppendResult,
    SessionInfo,
    speculative_summary,
)
from kakeya_lab.session.state import SessionState
from kakeya_lab.session.stream import GenerationStream
from kakeya_lab.verifier import Verifier

if TYPE_CHECKING:
    from kakeya_lab.backends.torch_batch import StepBatcher
    from kakeya_lab.cost_model import CostModel
    from kakeya_lab.proposers import Proposer

CapacityPolicy = Literal["reject", "evict_lru"]


def model_eos_ids(model: PreTrainedModel) -> frozenset[int]:
    """The end-of-sequence ids the model declares: its generation config, else its config
    (transformers), or ``eos_token_ids`` (set on MLX models by ``load_mlx_model``)."""
    declared = getattr(model, "eos_token_ids", None)
    if declared is not None:
        return frozenset(int(t) for t in declared)
    eos = getattr(model.generation_config, "eos_token_id", None) or model.config.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else list(eos or []))


class SessionStore:
    """Owns sessions over one model; each session has its own verifier and cache.

    ``capacity`` bounds open sessions; ``policy`` says what ``create`` does when full:
    ``"reject"`` raises :class:`CapacityExceeded`, ``"evict_lru"`` closes the least
    recently used session. Sessions idle longer than ``idle_ttl_s`` are closed at the
    next call into the store (see the module docstring for streams). ``check_invariants``
    verifies the cache mirror after every mutation (cheap; on by default).
    ``block_padding`` is every session verifier's (:class:`~kakeya_lab.verifier.Verifier`).
    ``batch`` (torch Llama/Qwen models): the steps of sessions generating concurrently (in
    threads, as the server runs them) share forwards: each session's next token, or its
    speculative block, goes into one forward with every other step already waiting
    (:class:`~kakeya_lab.backends.torch_batch.StepBatcher`, ``batcher``); each session's
    commits, rollbacks, sampling and semantics stay its own, and greedy output is its solo
    run's up to float rounding. ``batch=None``: batch when the model allows it.
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
        block_padding: Mapping[int, int] | None = None,
        batch: bool | None = False,
    ):
        capacity = inputs.count(capacity, "capacity", minimum=1, maximum=inputs.MAX_SIZE)
        if policy not in ("reject", "evict_lru"):
            raise ValueError(f"policy must be 'reject' or 'evict_lru', got {policy!r}")
        if idle_ttl_s is not None:
            idle_ttl_s = inputs.number(
                idle_ttl_s, "idle_ttl_s (None: never expire)", minimum=0.0, strict=True
            )
        prefill_chunk = inputs.count(
            prefill_chunk, "prefill_chunk", minimum=1, maximum=inputs.MAX_SIZE
        )
        if not isinstance(config, SinkWindowConfig):
            raise InputTypeError(f"config must be a SinkWindowConfig, got {type(config).__name__}")
        self.model = model
        self.vocab_size = vocab_size_of(model)
        self.config = config
        self.capacity = capacity
        self.policy = policy
        self.idle_ttl_s = idle_ttl_s
        self.prefill_chunk = prefill_chunk
        self.block_padding = dict(block_padding or {})
        self.check_invariants = check_invariants
        self.eos_token_ids = (
            inputs.stop_token_ids(eos_token_ids, self.vocab_size)
            if eos_token_ids is not None
            else model_eos_ids(model)
        )
        self.batcher: StepBatcher | None = None
        if batch is not False:  # None: batch where the model allows it
            from kakeya_lab.backends.torch_batch import BatchForward, StepBatcher

            if BatchForward.supports(model):
                self.batcher = StepBatcher(model)
            elif batch:
                raise ValueError(
                    "batch=True needs a torch Llama, Qwen2 or Qwen3 model of linear layers; "
                    f"this one is {type(model).__name__}: leave batch off"
                )
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        # Guards the session table only; never held while taking a session's lock.
        self._lock = threading.RLock()
        self.evicted: list[tuple[str, str]] = []  # (id, reason), most recent last
        self._drop_listeners: list[Callable[[str, object], None]] = []

    # --------------------------------------------------------------- lifecycle
    def create(self, *, metadata: object = None, claimed: bool = False) -> str:
        """Open a session and return its server-issued id. ``metadata`` is kept with the
        session for its creator (:meth:`metadata`, :meth:`claim_where`, :meth:`evict_lru`);
        ``claimed`` opens it already claimed (:meth:`claim`), so no other caller takes it
        before its creator does."""
        dropped: list[SessionState] = []
        try:
            with self._lock:
                dropped += self._expire_idle()
                if len(self._sessions) >= self.capacity:
                    if self.policy == "reject":
                        raise CapacityExceeded(
                            f"all {self.capacity} session slots are in use (policy 'reject'); close one first"
                        )
                    victim = next(iter(self._sessions))
                    dropped.append(self._drop(victim, "evicted: least recently used"))
                sid = secrets.token_hex(8)
                now = time.monotonic()
                verifier = Verifier(
                    self.model,
                    self.config,
                    prefill_chunk=self.prefill_chunk,
                    block_padding=self.block_padding,
                )
                if self.batcher is not None:
                    from kakeya_lab.backends.torch_batch import batch_verifier

                    batch_verifier(verifier, self.batcher)
                self._sessions[sid] = SessionState(
                    sid,
                    verifier,
                    created_s=now,
                    last_used_s=now,
                    last_seen_s=now,
                    metadata=metadata,
                    claimed=claimed,
                )
                return sid
        finally:
            self._free(dropped)

    def warm_up(self) -> None:
        """One throwaway step on a verifier like a session's (no session opened, nothing
        counted): the model's kernels pack what they read and make their per-shape state now
        rather than in the first session's first step (``exact``'s integer forms of the
        weights: a few seconds and over 100 MB for a 135M model), so that step's latency and
        the memory seen from then on are the steady ones."""
        verifier = Verifier(
            self.model,
            self.config,
            prefill_chunk=self.prefill_chunk,
            block_padding=self.block_padding,
        )
        try:
            verifier.append([0, 0])
            verifier.forward_block([0])
            verifier.rollback()
        finally:
            verifier.release()

    def close(self, session_id: str) -> None:
        """Close a session and free its cache. Unknown or already closed ids raise.

        An open stream of the session ends with :class:`SessionClosed` at its next ``next()``.
        """
        dropped: list[SessionState] = []
        try:
            with self._lock:
                dropped += self._expire_idle()
                self._lookup(session_id)
                dropped.append(self._drop(session_id, "closed"))
        finally:
            self._free(dropped)

    def __len__(self) -> int:
        return len(self.ids())

    def ids(self) -> list[str]:
        dropped: list[SessionState] = []
        try:
            with self._lock:
                dropped += self._expire_idle()
                return list(self._sessions)
        finally:
            self._free(dropped)

    # -------------------------------------------------------------- ownership
    def metadata(self, session_id: str) -> object:
        """What :meth:`create` attached to the session (None if nothing); raises
        :class:`UnknownSession` (with the reason) for a closed or evicted id."""
        return self._session(session_id).metadata

    def claim(self, session_id: str) -> None:
        """Hold the session for one caller (e.g. one HTTP request) until :meth:`release`.

        A claimed session is skipped by :meth:`evict_lru` and :meth:`claim_where`; a second
        claim raises :class:`SessionInUse`. The claim is advisory for the store's own calls
        (append, generate still work); it is how several callers share the table."""
        dropped: list[SessionState] = []
        try:
            with self._lock:
                dropped += self._expire_idle()
                session = self._lookup(session_id)
                if session.claimed:
                    raise SessionInUse(
                        f"session {session_id!r} is serving another request; retry after it"
                    )
                session.claimed = True
                self._touch(session)
        finally:
            self._free(dropped)

    def release(self, session_id: str) -> None:
        """End a :meth:`claim` and mark the session used now (no-op if it is gone)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                session.claimed = False
                self._touch(session)

    def claim_where(self, where: Callable[[object], bool]) -> list[str]:
        """Claim every unclaimed session whose metadata satisfies ``where``; their ids,
        least recently used first (release the ones you do not keep)."""
        dropped: list[SessionState] = []
        try:
            with self._lock:
                dropped += self._expire_idle()
                claimed = [
                    s for s in self._sessions.values() if not s.claimed and where(s.metadata)
                ]
                for s in claimed:
                    s.claimed = True
                return [s.id for s in claimed]
        finally:
            self._free(dropped)

    def evict_lru(
        self, where: Callable[[object], bool], reason: str, *, idle_for_s: float | None = None
    ) -> str | None:
        """Close the least recently used idle session (unclaimed, no open generation stream)
        whose metadata satisfies ``where`` and, if ``idle_for_s`` is given, that was last
        seen at least that long ago; its id, or None if no session qualifies."""
        dropped: list[SessionState] = []
        try:
            with self._lock:
                dropped += self._expire_idle()
                now = time.monotonic()
                victim = next(
                    (
                        s
                        for s in self._sessions.values()
                        if self._idle(s)
                        and where(s.metadata)
                        and (idle_for_s is None or now - s.last_seen_s >= idle_for_s)
                    ),
                    None,
                )
                if victim is None:
                    return None
                dropped.append(self._drop(victim.id, f"evicted: {reason}"))
                return victim.id
        finally:
            self._free(dropped)

    @staticmethod
    def _idle(session: SessionState) -> bool:
        """Evictable: not claimed, not computing, no open stream (never evicted mid-stream)."""
        return not session.claimed and session.computing == 0 and session.open_stream() is None

    def _drop(self, session_id: str, reason: str) -> SessionState:
        """Remove a session from the table (under the table lock); free it with :meth:`_free`."""
        session = self._sessions.pop(session_id)
        session.closed_reason = reason
        self.evicted.append((session_id, reason))
        del self.evicted[:-100]
        return session

    def _free(self, sessions: list[SessionState]) -> None:
        """Free dropped sessions' caches (after the table lock is released; waits for a
        stream that is computing an event), then tell the drop listeners."""
        for session in sessions:
            with session.lock:
                session.verifier.release()
                session.next_logits = None
                session.decoder = None
        for session in sessions:
            for listener in list(self._drop_listeners):
                listener(session.id, session.metadata)

    def on_drop(self, listener: Callable[[str, object], None]) -> None:
        """Call ``listener(session_id, metadata)`` after every session that leaves the table
        (closed, evicted, expired: whichever call ran it) has been freed, outside the
        store's locks: how a caller that shares the table frees its own per-session state
        and learns that a slot freed."""
        self._drop_listeners.append(listener)

    def next_expiry_s(self) -> float | None:
        """The ``time.monotonic()`` at which the idle TTL next closes a session (the least
        recently seen one not computing an event; it may already be due, closed by the next
        call into the store); None without a TTL or such a session."""
        if self.idle_ttl_s is None:
            return None
        with self._lock:
            seen = [s.last_seen_s for s in self._sessions.values() if s.computing == 0]
        return min(seen) + self.idle_ttl_s if seen else None

    def oldest_idle_seen_s(self, where: Callable[[object], bool]) -> float | None:
        """The earliest last-seen ``time.monotonic()`` of the idle sessions (those
        :meth:`evict_lru` may pick) whose metadata satisfies ``where``; None if there is none."""
        with self._lock:
            seen = [
                s.last_seen_s
                for s in self._sessions.values()
                if self._idle(s) and where(s.metadata)
            ]
        return min(seen) if seen else None

    def _expire_idle(self) -> list[SessionState]:
        if self.idle_ttl_s is None:
            return []
        now = time.monotonic()
        expired = [
            s.id
            for s in self._sessions.values()
            if s.computing == 0 and now - s.last_seen_s > self.idle_ttl_s
        ]
        return [self._drop(sid, f"evicted: idle longer than {self.idle_ttl_s}s") for sid in expired]

    def _lookup(self, session_id: str) -> SessionState:
        if not isinstance(session_id, str):
            raise InputTypeError(
                f"a session id is a string (from create()), got a {type(session_id).__name__}"
            )
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(self._unknown_message(session_id))
        return session

    def _unknown_message(self, session_id: str) -> str:
        reason = next((r for sid, r in reversed(self.evicted) if sid == session_id), None)
        detail = f" ({reason})" if reason else ""
        return f"unknown session id {session_id!r}{detail}"

    def _session(self, session_id: str) -> SessionState:
        """Expire idle sessions and return this one (then take its lock and call :meth:`_live`)."""
        dropped: list[SessionState] = []
        try:
            with self._lock:
                dropped += self._expire_idle()
                return self._lookup(session_id)
        finally:
            self._free(dropped)

    def _live(self, session: SessionState, *, idle: bool = False) -> None:
        """Under the session's lock: raise if it was dropped meanwhile, or (``idle``) if a
        stream is open."""
        if session.closed_reason is not None:
            with self._lock:
                raise UnknownSession(self._unknown_message(session.id))
        if idle and session.open_stream() is not None:
            raise SessionBusy(
                f"session {session.id!r} has an open generation stream: consume it to the end "
                "or call its close() before the next append/generate"
            )

    @staticmethod
    def _reconcile(session: SessionState) -> None:
        """Take over the result of the session's last generation (under the session's lock,
        no stream computing): settle its decoder (commit the delivered tokens, drop the rest
        of the step, append the last delivered token) and copy its next-token logits and
        counters; without one, drop a provisional block an interrupted call left open.
        Idempotent: an interrupted reconcile is finished by the next call."""
        decoder = session.decoder
        if decoder is None:
            session.verifier.rollback()
            return
        decoder.settle()
        with interrupts_deferred():
            if session.decoder is decoder:
                session.decoder = None
                session.next_logits = decoder.next_logits
                session.generated_tokens += decoder.delivered
                if decoder.proposer is not None:
                    stats = session.stats
                    stats["emitted"] = stats.get("emitted", 0) + decoder.delivered
                    stats["forwards"] = stats.get("forwards", 0) + decoder.verifier_forwards

    def _touch(self, session: SessionState, *, read: bool = False) -> None:
        """Mark a use (``read``: a read, which keeps the session alive and recent for the
        idle TTL and LRU order but is not reported as its last use)."""
        with self._lock:
            now = time.monotonic()
            session.last_seen_s = now
            if not read:
                session.last_used_s = now
            if session.id in self._sessions:
                self._sessions.move_to_end(session.id)

    # ---------------------------------------------------------------- mutation
    def append(self, session_id: str, token_ids: Sequence[int] | torch.Tensor) -> AppendResult:
        """Append (commit) ``token_ids`` to the session; all-or-nothing (also under an
        interrupt): the session is unchanged unless the append completes."""
        session = self._session(session_id)
        with session.lock:
            self._live(session, idle=True)
            self._reconcile(session)
            verifier = session.verifier
            history_before = verifier.history_len
            dropped_before = verifier.history_len - verifier.cache_len

            def committed(logits: torch.Tensor) -> None:  # in the verifier's commit section
                session.next_logits = logits
                session.turns += 1
                self._touch(session)

            t0 = time.perf_counter()
            try:
                verifier.append(token_ids, on_commit=committed)
            finally:
                release_thread_pool()  # see _run
            latency = time.perf_counter() - t0
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
        sampling: SamplingConfig | None = None,
        *,
        stop_token_ids: Sequence[int] | None = None,
        proposer: Proposer | None = None,
        draft_length: int = 4,
        adaptive_draft_length: bool = False,
        cost_model: CostModel | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> GenerationStream:
        """Generate up to ``max_new_tokens`` tokens; a stream of events.

        ``sampling=None`` is greedy. ``proposer=None`` is plain decoding; otherwise
        speculative decoding with drafts of ``draft_length`` tokens (greedy output is
        identical to plain decoding); ``adaptive_draft_length`` or a
        :class:`~kakeya_lab.cost_model.CostModel` (``cost_model``: the draft length with the
        most expected tokens per second, at most ``draft_length``) vary it per step. The session keeps exactly the tokens delivered as
        :class:`Token` events (EOS included), also if the caller stops early. Arguments are
        checked here, before the first event. Collect a whole reply with :func:`collect_reply`.
        ``cancelled``: asked after each token is computed, before it is delivered; once it
        is true the stream ends without that token (and without :class:`Done`), e.g. when
        the consumer's client left while the token was being computed.
        """
        if sampling is None:
            sampling = SamplingConfig()
        elif not isinstance(sampling, SamplingConfig):
            raise InputTypeError(
                f"sampling must be a SamplingConfig or None, got {type(sampling).__name__} "
                "(e.g. SamplingConfig(temperature=0.8, seed=0))"
            )
        inputs.count(max_new_tokens, "max_new_tokens", minimum=1, maximum=inputs.MAX_SIZE)
        inputs.count(draft_length, "draft_length", minimum=1, maximum=inputs.MAX_SIZE)
        stops = self.eos_token_ids | inputs.stop_token_ids(stop_token_ids, self.vocab_size)
        if proposer is not None:
            check_proposer(proposer)
        session = self._session(session_id)
        with session.lock:
            self._live(session, idle=True)
            self._reconcile(session)
            if session.next_logits is None:
                raise SessionError(
                    f"session {session_id!r} is empty: append a prompt before generate"
                )
            decoder = speculative.Decoder(
                session.verifier,
                session.next_logits,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop_token_ids=stops,
                proposer=proposer,
                draft_length=draft_length,
                adaptive_draft_length=adaptive_draft_length,
                cost_model=cost_model,
            )

            def deliver() -> int:  # the stream's hand-off (session lock held, SIGINT deferred)
                token = decoder.deliver()
                self._touch(session)
                return token

            session.decoder = decoder
            stream = GenerationStream(session, self._run(session, decoder, cancelled), deliver)
            session.stream = weakref.ref(stream)
            self._touch(session)
            return stream

    def _run(
        self,
        session: SessionState,
        decoder: speculative.Decoder,
        cancelled: Callable[[], bool] | None = None,
    ) -> Generator[Event, None, None]:
        """The body of a stream (runs under the session's lock, one event at a time).

        Tokens are offered, not delivered: the stream delivers each once ``next()`` has
        returned it, before it resumes (or closes) this body."""
        verifier = session.verifier
        start_history = verifier.history_len
        budget = self.config.budget
        truncation_reported = verifier.history_len > verifier.cache_len
        t_start = time.perf_counter()
        first_token_s = None
        try:
            while not decoder.finished:
                step = decoder.advance()
                if step is not None:
                    session.stats["steps"] = session.stats.get("steps", 0) + 1
                    session.stats["proposed"] = session.stats.get("proposed", 0) + step.proposed
                    session.stats["accepted"] = session.stats.get("accepted", 0) + step.accepted
                    yield step
                while decoder.batch:
                    if cancelled is not None and cancelled():
                        return  # the computed token is not delivered; settle drops it
                    history_after = start_history + decoder.delivered + 1
                    if budget is not None and history_after > budget and not truncation_reported:
                        truncation_reported = True
                        yield HistoryTruncated(dropped=history_after - budget)
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - t_start
                    yield Token(id=decoder.batch[0])
        finally:
            # a turn's computing is done: this thread's OpenMP pool would slow the threads
            # that compute next (backends/thread_pool.py)
            release_thread_pool()
            if self.batcher is not None:  # the next batch does not wait for this session
                self.batcher.leave(verifier.cache)
            if session.closed_reason is None:  # a dropped session's cache is gone: nothing to keep
                self._reconcile(session)
                self._check(session, expected_history=start_history + decoder.delivered)
        last = decoder.delivered_ids[-1] if decoder.delivered_ids else None
        total = time.perf_counter() - t_start
        stop_reason = decoder.stop_reason
        if stop_reason == "stop" and last in self.eos_token_ids:
            stop_reason = "eos"
        forwards = decoder.verifier_forwards
        yield Done(
            stop_reason=stop_reason,
            counts=GenerationCounts(
                generated_tokens=decoder.delivered,
                verifier_forwards=forwards,
                tau=decoder.delivered / forwards if forwards else None,
                proposed=sum(s.proposed for s in decoder.steps),
                accepted=sum(s.accepted for s in decoder.steps),
                history_len=verifier.history_len,
                cache_len=verifier.cache_len,
                kv_live_bytes=verifier.kv_live_bytes,
            ),
            timings=GenerationTimings(
                total_s=total,
                first_token_s=first_token_s,
                verifier_s=decoder.verifier_s,
                proposer_s=sum(s.proposer_s for s in decoder.steps),
                tokens_per_s=decoder.delivered / total if total > 0 else None,
            ),
        )

    def probe(
        self,
        session_id: str,
        token_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Greedy continuation of the session's history + ``token_ids`` (a side question),
        scored on a provisional block and rolled back: the session is unchanged afterwards.

        Stops after ``max_new_tokens`` or a stop/EOS token (included in the result).
        """
        inputs.count(max_new_tokens, "max_new_tokens", minimum=1, maximum=inputs.MAX_SIZE)
        stops = self.eos_token_ids | inputs.stop_token_ids(stop_token_ids, self.vocab_size)
        ids = inputs.token_ids(token_ids, self.vocab_size)
        session = self._session(session_id)
        with session.lock:
            self._live(session, idle=True)
            self._reconcile(session)
            verifier = session.verifier
            out: list[int] = []
            try:
                logits = verifier.forward_block(ids)[-1]
                while True:
                    token = int(torch.argmax(logits))
                    out.append(token)
                    if token in stops or len(out) == max_new_tokens:
                        break
                    logits = verifier.forward_block([token])[-1]
            finally:
                verifier.rollback()
            self._touch(session)
            self._check(session, expected_history=None)
            return out

    # ------------------------------------------------------------------- query
    def info(self, session_id: str) -> SessionInfo:
        """The session's state; reading it keeps the session alive and recent (idle TTL,
        LRU order), while ``last_used_s`` stays its last append or generation."""
        s = self._session(session_id)
        self._touch(s, read=True)
        with s.lock:
            self._live(s)
            if s.open_stream() is None:
                self._reconcile(s)
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
                speculative=speculative_summary(s.stats),
            )

    def kv_live_bytes(self) -> int:
        """Bytes of K and V held by all open sessions' caches; a monitoring read that, unlike
        :meth:`info`, keeps no session alive (a scrape must not defeat the idle TTL)."""
        with self._lock:
            sessions = list(self._sessions.values())
        total = 0
        for s in sessions:
            with s.lock:
                if s.closed_reason is None:
                    total += s.verifier.kv_live_bytes
        return total

    def next_token_logits(self, session_id: str) -> torch.Tensor | None:
        """A copy of the logits ``[vocab]`` after the session's history (None if empty);
        reading them keeps the session alive and recent (idle TTL, LRU order)."""
        s = self._session(session_id)
        self._touch(s, read=True)
        with s.lock:
            self._live(s)
            if s.open_stream() is None:
                self._reconcile(s)
            return None if s.next_logits is None else s.next_logits.clone()

    def verifier(self, session_id: str) -> Verifier:
        """The session's verifier (read its state; mutate only through the store)."""
        return self._session(session_id).verifier

    # -------------------------------------------------------------- invariants
    def _check(self, session: SessionState, expected_history: int | None) -> None:
        if self.check_invariants:
            session.check_cache_mirror(self.config, expected_history)
