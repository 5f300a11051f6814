"""A live conversation with one session: replies streamed on a background thread, stoppable.

:class:`LiveChat` is the logic behind :class:`~kakeya_lab.widgets.chat_panel.ChatPanel`
and has no UI. :meth:`LiveChat.send` appends the chat-templated user turn and consumes the
session's ``generate`` stream on a worker thread, so the caller's thread (a notebook
kernel handling a Stop click) stays free. :meth:`LiveChat.stop` asks the worker to stop
after the token it is handling; the worker then closes the stream, and the session keeps
the tokens that were delivered (docs/design.md, "Session runtime"). Afterwards the reply
is read back from the session's history: :attr:`ReplyRecord.undelivered_tokens` counts
tokens the session committed that the stream never delivered (0 when the runtime keeps
its contract) and the shown reply is always the one the session holds.

Each token is tagged ``"draft"`` (an accepted draft token of a speculative step) or
``"verifier"`` (plain decoding, or the verifier's own correction/bonus token), from the
``SpeculativeStep`` events that precede a step's tokens.

Proposers that load weights (a draft model, a named drafter) load on a background loader
thread the first time they are used: the reply's record says ``loading`` meanwhile, and
Stop during the load ends the turn at once without sending anything (the load finishes in
the background and is kept for the next turn). :meth:`LiveChat.reset` starts a new
conversation; :meth:`LiveChat.transcript` and :meth:`LiveChat.transcript_markdown` export
it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field

from kakeya_lab.backends.config import SinkWindowConfig, analytic_kv_budget_bytes
from kakeya_lab.backends.thread_pool import release_thread_pool, released
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.proposers import check_proposer_spec, make_proposer
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.session import (
    Done,
    HistoryTruncated,
    SessionStore,
    SpeculativeStep,
    StreamingDetokenizer,
    Token,
    chat_turn,
    text_pieces,
)

STOPPED_BY_USER = "stopped"


@dataclass
class ReplyRecord:
    """One user turn and the reply the session holds for it. ``turn`` counts the
    conversation's user turns from 1."""

    turn: int
    user_text: str
    proposer: str
    draft_length: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    loading: str | None = None  # the proposer spec being loaded before the reply starts
    token_ids: list[int] = field(default_factory=list)
    token_kinds: list[str] = field(default_factory=list)  # "draft" or "verifier", per token
    pieces: list[str] = field(default_factory=list)  # the text each token added, as shown
    token_latency_s: list[float] = field(default_factory=list)  # since the previous token
    append_latency_s: float | None = None
    history_start: int | None = None  # history length before the reply's first token
    stop_reason: str | None = None  # eos / stop / max_tokens / stopped / error
    error: str | None = None
    undelivered_tokens: int = 0  # committed by the session but never delivered
    dropped_tokens: int = 0  # history no longer attended (HistoryTruncated)
    finished: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass(frozen=True)
class CacheSnapshot:
    """What the session's cache holds now (tokens) and its KV bytes against the budget."""

    history_tokens: int
    sink_tokens: int
    window_tokens: int
    evicted_tokens: int
    kv_live_bytes: int
    kv_budget_bytes: int | None  # analytic ``B × layers × kv_heads × head_dim × bytes × 2``


class LiveChat:
    """A conversation over one session of a :class:`~kakeya_lab.session.SessionStore`.

    ``source`` is a ``SessionStore`` (then ``tokenizer`` is required) or a loaded model
    (``load_model(...)``; a one-session store over ``config`` is made). Greedy decoding
    unless a turn is sent with other ``sampling``. ``verifier_sha256`` (taken from a loaded model's description when not given) lets
    ``drafter:NAME`` proposers check that a named drafter was trained for this verifier.
    One reply streams at a time; ``send`` while streaming raises ``RuntimeError``.
    """

    def __init__(
        self,
        source,
        config: SinkWindowConfig | None = None,
        *,
        tokenizer=None,
        system: str | None = None,
        max_new_tokens: int = 128,
        latency_history_tokens: int = 2000,
        verifier_sha256: str | None = None,
    ):
        description = getattr(source, "description", None)
        if verifier_sha256 is None and description is not None:
            verifier_sha256 = description.weight_sha256
        self.model_name: str | None = getattr(description, "name", None)
        # the verifier's weights, which a named drafter (``drafter:NAME``) must have been made for
        self.verifier_sha256 = verifier_sha256
        if isinstance(source, SessionStore):
            store = source
            if tokenizer is None:
                raise ValueError("a SessionStore carries no tokenizer: pass tokenizer=...")
        elif hasattr(source, "model") and hasattr(source, "tokenizer"):
            if config is None:
                raise ValueError("pass the cache config, e.g. SinkWindowConfig(sink=4, window=252)")
            store = SessionStore(source.model, config, capacity=1)
            tokenizer = tokenizer or source.tokenizer
        else:
            raise TypeError(
                f"expected a SessionStore or a loaded model, got {type(source).__name__}"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.store = store
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.system = system
        self.session_id = store.create()
        self.chat = ChatTemplate(tokenizer, system=system)
        self.replies: list[ReplyRecord] = []
        self.token_latencies: deque[tuple[int, float]] = deque(maxlen=latency_history_tokens)
        self.kv_budget_bytes = analytic_kv_budget_bytes(store.model, store.config)
        self._proposers: dict[str, Future] = {}
        self._loader: ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None

    # ------------------------------------------------------------------ state
    @property
    def streaming(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def cache_snapshot(self) -> CacheSnapshot:
        info = self.store.info(self.session_id)
        sinks = min(self.store.config.sink, info.cache_len)
        return CacheSnapshot(
            history_tokens=info.history_len,
            sink_tokens=sinks,
            window_tokens=info.cache_len - sinks,
            evicted_tokens=info.history_len - info.cache_len,
            kv_live_bytes=info.kv_live_bytes,
            kv_budget_bytes=self.kv_budget_bytes,
        )

    def session_reply_ids(self, index: int = -1) -> list[int]:
        """The token ids the *session* holds for reply ``index`` (read from its history)."""
        record = self.replies[index]
        if record.history_start is None:
            return []
        history = self.store.verifier(self.session_id).history_token_ids
        return history[record.history_start : record.history_start + len(record.token_ids)]

    def latency_by_turn(self) -> list[float]:
        """Mean seconds per token of every finished reply, first token excluded (a mean, not
        a median: speculative steps deliver their tokens in bursts)."""
        out = []
        for r in self.replies:
            lat = r.token_latency_s[1:]
            if r.finished and lat:
                out.append(statistics.fmean(lat))
        return out

    def proposer(self, spec: str):
        """The proposer for ``spec`` (``none``, ``ngram``, ``early-exit:N``,
        ``drafter:NAME``), built once (waits for a load in progress; raises what the
        build raised, and a later call tries again)."""
        if spec in ("", "none", None):
            return None
        return self._load(spec).result()

    def _load(self, spec: str) -> Future:
        """The proposer for ``spec`` as a future, building it on the loader thread the first
        time; a failed build is forgotten so the next use retries."""
        future = self._proposers.get(spec)
        if future is not None and future.done() and future.exception() is not None:
            future = None
        if future is None:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="live-chat-loader")
            future = self._loader.submit(
                released(make_proposer),
                spec,
                self.store.model,
                self.store.config,
                self.tokenizer,
                verifier_sha256=self.verifier_sha256,
            )
            self._proposers[spec] = future
        return future

    # ----------------------------------------------------------------- actions
    def send(
        self,
        text: str,
        *,
        proposer: str = "none",
        draft_length: int = 4,
        max_new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        on_token: Callable[[ReplyRecord], None] | None = None,
        on_done: Callable[[ReplyRecord], None] | None = None,
        on_loading: Callable[[ReplyRecord], None] | None = None,
    ) -> ReplyRecord:
        """Start a reply to ``text`` on a worker thread and return its (growing) record.

        ``sampling`` defaults to greedy. ``on_loading(record)`` runs on the worker when the
        proposer must be loaded first (``record.loading`` names it), ``on_token(record)``
        after every delivered token, ``on_done(record)`` once at the end (also after an
        error or a stop).
        """
        if self.streaming:
            raise RuntimeError("a reply is still streaming: stop it or wait for it first")
        if not text or not text.strip():
            raise ValueError("empty message: type something to send")
        if isinstance(draft_length, bool) or not isinstance(draft_length, int) or draft_length < 1:
            raise ValueError(f"draft_length must be an integer >= 1, got {draft_length!r}")
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        spec = proposer or "none"
        check_proposer_spec(spec)  # a malformed spec is refused here, before anything runs
        future = None if spec == "none" else self._load(spec)
        record = ReplyRecord(
            turn=len(self.replies) + 1,
            user_text=text,
            proposer=spec,
            draft_length=draft_length,
            sampling=sampling or SamplingConfig(),
        )
        self.replies.append(record)
        self._stop.clear()
        self._worker = threading.Thread(
            target=self._run,
            args=(
                record,
                future,
                max_new_tokens or self.max_new_tokens,
                on_token,
                on_done,
                on_loading,
            ),
            name=f"live-chat-turn-{record.turn}",
            daemon=True,
        )
        release_thread_pool()  # the worker computes now (backends/thread_pool.py)
        self._worker.start()
        return record

    def reset(self) -> None:
        """Start a new conversation: a fresh session (the old one is closed), no replies,
        no latency history. Refused while a reply streams. Loaded proposers are kept."""
        if self.streaming:
            raise RuntimeError("a reply is still streaming: stop it or wait for it first")
        self.store.close(self.session_id)  # first: a one-session store has no second slot
        self.session_id = self.store.create()
        self.chat = ChatTemplate(self.tokenizer, system=self.system)
        self.replies.clear()
        self.token_latencies.clear()

    def stop(self) -> None:
        """Stop the streaming reply after the token being handled (no-op when idle)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> ReplyRecord | None:
        """Wait for the streaming reply to finish; the latest record (None before any)."""
        if self._worker is not None:
            self._worker.join(timeout)
        return self.replies[-1] if self.replies else None

    # ------------------------------------------------------------------ worker
    def _run(
        self,
        record: ReplyRecord,
        future: Future | None,
        max_new_tokens: int,
        on_token,
        on_done,
        on_loading,
    ) -> None:
        try:
            prop = self._wait_for_proposer(record, future, on_loading)
            if record.stop_reason == STOPPED_BY_USER:
                return  # stopped while the proposer loaded: nothing was sent
            # the one chat-turn loop: the template is restored if the append fails and
            # records exactly the delivered tokens when the turn's stream ends
            turn = chat_turn(
                self.store,
                self.session_id,
                self.chat,
                record.user_text,
                max_new_tokens,
                proposer=prop,
                draft_length=record.draft_length,
                sampling=record.sampling,
            )
            assert turn.appended is not None  # chat_turn always appends the user turn
            record.append_latency_s = turn.appended.latency_s
            record.history_start = turn.appended.history_len
            self._consume(record, turn, on_token)
            self._reconcile(record)
        except Exception as exc:  # shown in the panel; the session stays as the store left it
            record.error = f"{type(exc).__name__}: {exc}"
            record.stop_reason = "error"
            if record.history_start is not None:
                self._reconcile(record)
        finally:
            record.finished = True
            if on_done is not None:
                on_done(record)

    def _wait_for_proposer(self, record: ReplyRecord, future: Future | None, on_loading):
        """The turn's proposer, waiting for its load while watching Stop (which ends the
        turn before anything is appended)."""
        if future is None:
            return None
        if not future.done():
            record.loading = record.proposer
            if on_loading is not None:
                on_loading(record)
        try:
            while True:
                try:
                    return future.result(timeout=0.05)
                except FutureTimeout:
                    if self._stop.is_set():
                        record.stop_reason = STOPPED_BY_USER
                        return None
        finally:
            record.loading = None

    def _consume(self, record: ReplyRecord, events, on_token) -> None:
        draft_tokens_ahead = 0  # accepted drafts of the current step still to be delivered
        last = time.perf_counter()
        detok = StreamingDetokenizer(self._decode)
        try:
            for event in events:
                if isinstance(event, SpeculativeStep):
                    if self._stop.is_set():
                        record.stop_reason = STOPPED_BY_USER
                        break
                    draft_tokens_ahead = min(event.accepted, event.emitted)
                elif isinstance(event, Token):
                    now = time.perf_counter()
                    kind = "draft" if draft_tokens_ahead > 0 else "verifier"
                    draft_tokens_ahead = max(0, draft_tokens_ahead - 1)
                    record.token_ids.append(event.id)
                    record.token_kinds.append(kind)
                    record.token_latency_s.append(now - last)
                    self.token_latencies.append((record.turn, now - last))
                    last = now
                    record.pieces.append(detok.add(event.id))
                    if on_token is not None:
                        on_token(record)
                    if self._stop.is_set():
                        record.stop_reason = STOPPED_BY_USER
                        break
                elif isinstance(event, HistoryTruncated):
                    record.dropped_tokens = event.dropped
                elif isinstance(event, Done):
                    record.stop_reason = event.stop_reason
        finally:
            events.close()

    def _reconcile(self, record: ReplyRecord) -> None:
        """Make the record say what the session holds (the turn has recorded the delivered
        tokens in the chat template)."""
        history = self.store.verifier(self.session_id).history_token_ids
        held = history[record.history_start :] if record.history_start is not None else []
        record.undelivered_tokens = len(held) - len(record.token_ids)
        if held != record.token_ids:
            record.token_ids = list(held)
            record.token_kinds = (record.token_kinds + ["verifier"] * len(held))[: len(held)]
        record.pieces = text_pieces(self._decode, held)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ export
    def transcript(self) -> dict:
        """The conversation as plain data (JSON-ready): the model (name and weight hash),
        backend, cache settings, the session's whole history of token ids, and per turn
        the user text, proposer, draft length, sampling, the reply's token ids, text,
        per-token kinds (``draft`` = an accepted draft token, ``verifier`` = decoded or
        corrected by the verifier) and per-token latency (seconds since the previous
        token; the first one since the turn started)."""
        from kakeya_lab.backends import registry

        info = self.store.info(self.session_id)
        return {
            "model": self.model_name,
            "weight_sha256": self.verifier_sha256,
            "backend": registry.name_of(self.store.model),
            "cache": asdict(self.store.config),
            "system": self.system,
            "history_token_ids": list(self.store.verifier(self.session_id).history_token_ids),
            "history_tokens": info.history_len,
            "cache_tokens": info.cache_len,
            "kv_live_bytes": info.kv_live_bytes,
            "turns": [
                {
                    "turn": r.turn,
                    "user": r.user_text,
                    "proposer": r.proposer,
                    "draft_length": r.draft_length,
                    "sampling": asdict(r.sampling),
                    "reply": r.text,
                    "token_ids": list(r.token_ids),
                    "token_kinds": list(r.token_kinds),
                    "token_latency_s": list(r.token_latency_s),
                    "stop_reason": r.stop_reason,
                    "error": r.error,
                }
                for r in self.replies
            ],
        }

    def transcript_markdown(self) -> str:
        """The conversation as Markdown: a header with the model and cache, then each turn's
        message and reply with its proposer, token count and latency."""
        cfg = self.store.config
        lines = [
            "# Conversation",
            "",
            f"model `{self.model_name or 'unnamed'}` · cache sink {cfg.sink} + window {cfg.window}",
            "",
        ]
        for r in self.replies:
            p50, p95 = token_latency_percentiles(r)
            timing = (
                f", p50 {1e3 * p50:.1f} ms/token, p95 {1e3 * p95:.1f}"
                if p50 is not None and p95 is not None
                else ""
            )
            lines += [
                f"## Turn {r.turn}",
                "",
                f"**you:** {r.user_text}",
                "",
                f"**model** ({r.proposer}, {plural(len(r.token_ids), 'token')}{timing}, "
                f"stop: {r.stop_reason}):",
                "",
                r.text,
                "",
            ]
        return "\n".join(lines)


def plural(n: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def token_latency_percentiles(record: ReplyRecord) -> tuple[float | None, float | None]:
    """p50 and p95 of a reply's per-token latency in seconds, its first token (the wait
    for the turn's prefill) excluded; None with fewer than two tokens."""
    lat = sorted(record.token_latency_s[1:])
    if not lat:
        return None, None
    return statistics.median(lat), lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]


@dataclass(frozen=True)
class LatencyDrift:
    """The slope of the per-turn mean ms/token over the last ``turns`` finished replies,
    with its 95% interval (ms per turn)."""

    turns: int
    slope_ms: float
    low_ms: float
    high_ms: float


def latency_drift(means_s: list[float], last: int = 20) -> LatencyDrift | None:
    """The drift of ``means_s`` (per-turn mean seconds per token, oldest first) over the
    last ``last`` values: OLS slope and 95% interval; None with fewer than three."""
    import numpy as np

    from kakeya_lab.bench.aggregate import slope_ci

    y = np.asarray(means_s[-last:], dtype=float) * 1e3
    if len(y) < 3:
        return None
    slope, low, high = slope_ci(np.arange(len(y), dtype=float), y)
    return LatencyDrift(len(y), slope, low, high)
