"""Served sessions: a :class:`~kakeya_lab.session.SessionStore` plus what serving adds.

Both front ends (gRPC and HTTP) go through :class:`ServedSessions`. The store's table is
the only session table: each session's serving state (:class:`ServedSession`) is the
store's metadata for it, a request holds its session with the store's claims, and
eviction follows the store's least-recently-used order.

* owners: every session records its creator's owner (a hash of the API key, or
  :data:`ANONYMOUS` on a keyless server); a session of another owner is unknown to a caller
  (as if it did not exist), so ids, histories and ``cached_tokens`` never reveal it;
* admission (:mod:`kakeya_lab.serve.admission`) when the store is full; sessions that HTTP
  opened implicitly (for stateless requests) are evicted least-recently-used first (with
  ``evict_lru``, any idle session); a session that is streaming or held by a request is
  never evicted; implicit sessions idle longer than ``implicit_ttl_s`` are closed;
* a :class:`~kakeya_lab.chat.ChatTemplate` per session for text appends (a session that
  receives raw token ids is in *token mode* afterwards and refuses text);
* :meth:`ServedSessions.attach` — prefix reuse: the token ids of a rendered conversation
  are matched against the histories of the caller's own *implicit* sessions (an explicit
  session, made by CreateSession / ``POST /v1/sessions`` or named by its client, is never
  matched), so only the new tokens are prefilled;
* :meth:`ServedSessions.generate` — the store's stream with cancellation, shutdown and
  metrics, through the one chat-turn loop (:class:`~kakeya_lab.session.turn.ChatTurn`): it
  closes the store stream on every exit, so the session keeps exactly the tokens its
  stream returned (less a last one the front end retracts: its client never got it), and a
  text session's template records them as the reply;
* proposers (:mod:`kakeya_lab.serve.served_proposers`): the model-free kinds, built per
  request, and the draft models loaded at startup, whose per-session proposer (its own
  draft cache over the shared weights) is built when the session first names it and freed
  with the session;
* limits on request sizes, the proposer and the stop set (a generation with no stop at
  all, no end-of-sequence id and no stop id or string, is refused unless the request
  allows it), checked before any state changes;
* a tokenizer without a chat template serves token-id sessions (create, append ids,
  generate); only the chat-text operations are refused, naming the missing template.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kakeya_lab import inputs
from kakeya_lab.backends import registry
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.proposers import ProposerKind, proposer_kind, proposer_kinds
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.serve.admission import Admission, ServerShuttingDown
from kakeya_lab.serve.api_keys import ANONYMOUS
from kakeya_lab.serve.memory import trim_heap
from kakeya_lab.serve.metrics import ServeMetrics
from kakeya_lab.serve.served_proposers import (
    ServedProposers,
    draft_cache_bytes,
    release_draft_caches,
)
from kakeya_lab.session import (
    AppendResult,
    CapacityExceeded,
    ChatTurn,
    Done,
    Event,
    SessionError,
    SessionStore,
    Token,
    UnknownSession,
    append_message,
)


def served_proposer_kinds() -> list[ProposerKind]:
    """The proposer kinds every server serves without loading anything: the registry's
    model-free ones, built per request from the session's own history (draft models are
    served once loaded: :class:`~kakeya_lab.serve.served_proposers.ServedProposers`)."""
    return [kind for kind in proposer_kinds() if kind.model_free]


def no_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` has no chat template (a base model's): token ids only."""
    return getattr(tokenizer, "chat_template", None) is None


@dataclass(frozen=True)
class ServeLimits:
    """Per-request bounds (oversized requests are refused before any state changes)."""

    max_append_tokens: int = 8192
    max_new_tokens: int = 2048


@dataclass(frozen=True)
class GenerateOptions:
    """One generation request. ``proposer`` is ``none``, a model-free spec or one naming a
    loaded draft model. ``stop_strings`` (HTTP's ``stop``; matched by the front end) count
    as stops; ``allow_no_stop`` accepts a generation with no stop at all (it runs to
    ``max_new_tokens``)."""

    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()
    proposer: str = "none"
    draft_length: int = 4
    adaptive_draft_length: bool = False
    stop_strings: tuple[str, ...] = ()
    allow_no_stop: bool = False


@dataclass(eq=False)
class ServedSession:
    """Serving-side state of one store session, kept as the store's metadata for it (the
    store's claims say which request holds it; its LRU order, when it was last used)."""

    origin: str  # "grpc" | "http"
    implicit: bool  # opened by HTTP for a stateless request (reusable, evictable, TTL)
    chat: ChatTemplate | None  # None: token mode (raw ids were appended, or no template)
    owner: str = ANONYMOUS  # who made it: only this owner sees it
    id: str = ""  # the store's id, set once the store has opened the session
    appended_tokens: int = 0
    prefill_s: float = 0.0
    generations: int = 0
    # spec -> this session's proposer of a loaded draft model (its own draft cache)
    proposers: dict[str, object] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def draft_cache_bytes(self) -> int:
        """Bytes of K and V held by this session's draft caches."""
        with self.lock:
            proposers = list(self.proposers.values())
        return sum(draft_cache_bytes(p) for p in proposers)

    def release_proposers(self) -> None:
        """Free this session's draft caches (the session left the store)."""
        with self.lock:
            proposers = list(self.proposers.values())
            self.proposers.clear()
        for proposer in proposers:
            release_draft_caches(proposer)


def _is_implicit(metadata: object) -> bool:
    return isinstance(metadata, ServedSession) and metadata.implicit


def _any_session(metadata: object) -> bool:
    return True


@dataclass(frozen=True)
class Attached:
    """A session bound to an HTTP request: ``reused_tokens`` of the conversation were already
    in it; ``appended`` says what was prefilled (None when nothing was new)."""

    session: ServedSession
    reused_tokens: int
    prompt_tokens: int
    appended: AppendResult | None
    queued_s: float


class ServedStream(Iterator[Event]):
    """The events of one served generation (what :meth:`ServedSessions.generate` returns).

    Iterate it and ``close()`` it (also a context manager): the session keeps exactly the
    tokens ``next()`` returned, less a last one a front end retracts (:meth:`retract`)
    because its client never got it.
    """

    def __init__(self, events: Generator[Event, None, None], turn: ChatTurn):
        self._events = events
        self._turn = turn

    def __next__(self) -> Event:
        return next(self._events)

    def retract(self) -> bool:
        """The last token ``next()`` returned could not be sent (the client had left): the
        session will not keep it. Call it before ``close()``; returns whether there was one
        (:meth:`kakeya_lab.session.GenerationStream.retract`)."""
        return self._turn.retract()

    def close(self) -> None:
        """End the generation; the session settles (idempotent)."""
        self._events.close()

    def __enter__(self) -> ServedStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ServedSessions:
    """Thread-safe serving layer over one store (see the module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        tokenizer,
        admission: Admission,
        limits: ServeLimits = ServeLimits(),
        model_name: str = "model",
        verifier_sha256: str | None = None,
        *,
        evict_lru: bool = False,
        implicit_ttl_s: float | None = 600.0,
        proposers: ServedProposers | None = None,
    ):
        if implicit_ttl_s is not None and not implicit_ttl_s > 0:
            raise ValueError(f"implicit_ttl_s must be > 0 (None: never), got {implicit_ttl_s}")
        self.store = store
        self.evict_lru = evict_lru  # when full, close the least recently used idle session
        self.implicit_ttl_s = implicit_ttl_s
        self.verifier_sha256 = verifier_sha256
        self.tokenizer = tokenizer
        self.admission = admission
        self.limits = limits
        self.model_name = model_name
        self.proposers = (
            proposers
            if proposers is not None
            else ServedProposers(
                store.model, store.config, tokenizer, verifier_sha256=verifier_sha256
            )
        )
        self.shutting_down = threading.Event()
        self._running = 0  # generations running now (the heap is trimmed when none is)
        self._running_lock = threading.Lock()
        self.metrics = ServeMetrics(
            open_sessions=self._open_sessions,
            kv_live_bytes=self._kv_live_bytes,
            admission_waiting=lambda: admission.waiting,
        )
        # whoever closes, evicts or expires a session (a waiter's retry, a scrape, a close):
        # its draft caches are freed and queued creations are woken
        store.on_drop(self._dropped)
        if admission.next_expiry is None:
            admission.next_expiry = self.next_expiry_s

    def _dropped(self, session_id: str, metadata: object) -> None:
        if isinstance(metadata, ServedSession):
            metadata.release_proposers()
        self.admission.released()
        self._trim_if_idle()

    def _trim_if_idle(self) -> None:
        """Hand freed heap memory back to the system (:func:`trim_heap`) unless a
        generation is running: after the last generation of a burst ends, and after a
        session's caches are freed."""
        with self._running_lock:
            if self._running:
                return
        trim_heap()

    def next_expiry_s(self) -> float | None:
        """The ``time.monotonic()`` at which an idle TTL (the store's, or ``implicit_ttl_s``
        for implicit sessions) next frees a slot without any call; None if none is due."""
        due = [self.store.next_expiry_s()]
        if self.implicit_ttl_s is not None:
            seen = self.store.oldest_idle_seen_s(_is_implicit)
            due.append(None if seen is None else seen + self.implicit_ttl_s)
        times = [t for t in due if t is not None]
        return min(times) if times else None

    def shutdown(self) -> None:
        """Stop: new work is refused, open streams end at their next token, and every
        creation waiting for a slot is refused now (gRPC ``UNAVAILABLE``, HTTP 503)."""
        self.shutting_down.set()
        self.admission.shutdown()

    # ---------------------------------------------------------------- helpers
    def _open_sessions(self) -> float:
        self.expire_implicit()
        return float(len(self.store))

    def _kv_live_bytes(self) -> float:
        """The sessions' caches and their draft caches (a scrape keeps no session alive)."""
        drafts = 0
        for sid in self.store.ids():
            try:
                served = self.store.metadata(sid)
            except UnknownSession:  # closed meanwhile
                continue
            if isinstance(served, ServedSession):
                drafts += served.draft_cache_bytes()
        return float(self.store.kv_live_bytes() + drafts)

    def check_running(self) -> None:
        if self.shutting_down.is_set():
            raise ServerShuttingDown("the server is shutting down; no new work is accepted")

    def get(self, session_id: str, owner: str | None = None) -> ServedSession:
        """The served session, or :class:`UnknownSession` (also if the store dropped it, and
        if ``owner`` is given and the session is another owner's: the same message as for an
        id that never existed). ``owner`` None: no check (the caller already holds it)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string (what CreateSession returned)")
        served = self.store.metadata(session_id)  # UnknownSession with the store's reason
        if not isinstance(served, ServedSession):
            raise UnknownSession(f"unknown session id {session_id!r} (not a served session)")
        if owner is not None and served.owner != owner:
            raise UnknownSession(f"unknown session id {session_id!r}")
        return served

    # -------------------------------------------------------------- lifecycle
    def create(
        self,
        *,
        origin: Literal["grpc", "http"],
        implicit: bool = False,
        system_prompt: str | None = None,
        claimed: bool = False,
        owner: str = ANONYMOUS,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[ServedSession, float]:
        """Admit and open a session for ``owner``; returns it and the seconds spent queued.
        ``claimed``: opened claimed for the calling request (release it with :meth:`detach`).
        When full, an idle implicit session is evicted (with ``evict_lru``, any idle one).
        ``cancelled``: the caller went away (a queued wait ends; see :class:`Admission`)."""
        self.check_running()
        if system_prompt is not None and no_chat_template(self.tokenizer):
            raise ValueError(self._no_template("a system prompt"))
        text = origin == "grpc" and not no_chat_template(self.tokenizer)
        chat = ChatTemplate(self.tokenizer, system=system_prompt) if text else None
        served = ServedSession(origin=origin, implicit=implicit, chat=chat, owner=owner)
        evicted = []

        def take_slot() -> str:
            self.expire_implicit()
            try:
                return self.store.create(metadata=served, claimed=claimed)
            except CapacityExceeded:
                if not (self._evict(_is_implicit, "evicted_implicit") or self._evict_any()):
                    raise
                evicted.append(True)
                return self.store.create(metadata=served, claimed=claimed)

        try:
            sid, queued_s = self.admission.admit(take_slot, cancelled)
        except ServerShuttingDown:
            raise
        except Exception:
            self.metrics.admission.labels("rejected").inc()
            raise
        outcome = "queued" if queued_s > 0 else "evicted" if evicted else "admitted"
        self.metrics.admission.labels(outcome).inc()
        served.id = sid
        self.metrics.sessions_created.labels(origin).inc()
        return served, queued_s

    def _evict_any(self) -> bool:
        return self.evict_lru and self._evict(_any_session, "evicted_lru")

    def _evict(
        self, where: Callable[[object], bool], reason: str, idle_for_s: float | None = None
    ) -> bool:
        """Close the least recently used idle session ``where`` selects (``idle_for_s``:
        only one idle that long); False if there is none."""
        why = {
            "evicted_implicit": "least recently used implicit HTTP session",
            "evicted_lru": "least recently used session",
            "expired_implicit": f"implicit session idle longer than {idle_for_s}s",
        }[reason]
        if self.store.evict_lru(where, why, idle_for_s=idle_for_s) is None:
            return False  # (a drop wakes queued creations: _dropped)
        self.metrics.sessions_closed.labels(reason).inc()
        return True

    def expire_implicit(self) -> None:
        """Close the implicit sessions idle longer than ``implicit_ttl_s``."""
        if self.implicit_ttl_s is not None:
            while self._evict(_is_implicit, "expired_implicit", self.implicit_ttl_s):
                pass

    def close(self, session_id: str, owner: str | None = None) -> None:
        """Close the session (``owner``: as :meth:`get`)."""
        self.get(session_id, owner)
        self.store.close(session_id)  # an open stream ends with SessionClosed; wakes waiters
        self.metrics.sessions_closed.labels("closed").inc()

    # ----------------------------------------------------------------- append
    def _check_size(self, ids: Sequence[int]) -> list[int]:
        ids = inputs.token_ids(ids, self.store.vocab_size)
        if len(ids) > self.limits.max_append_tokens:
            raise ValueError(
                f"{len(ids)} tokens in one append is more than this server's limit "
                f"{self.limits.max_append_tokens}: split it into smaller appends"
            )
        return ids

    def append_ids(
        self, session_id: str, token_ids: Sequence[int], owner: str | None = None
    ) -> AppendResult:
        """Commit raw token ids (the session is in token mode afterwards)."""
        self.check_running()
        served = self.get(session_id, owner)
        result = self._append(served, self._check_size(token_ids))
        served.chat = None
        return result

    def append_text(
        self,
        session_id: str,
        role: Literal["user", "assistant"],
        text: str,
        owner: str | None = None,
    ) -> AppendResult:
        """Render a user or assistant message through the session's chat template and commit
        its ids; the template is unchanged if anything fails."""
        self.check_running()
        served = self.get(session_id, owner)
        if not isinstance(text, str):
            raise inputs.InputTypeError(f"message text must be a string, got {type(text).__name__}")
        chat = served.chat
        if chat is None and no_chat_template(self.tokenizer):
            raise ValueError(self._no_template("text messages"))
        if chat is None:
            raise ValueError(
                f"session {session_id!r} is in token mode (raw token ids were appended): "
                "keep appending token ids, or create a new session for text"
            )
        if role not in ("user", "assistant"):
            raise ValueError(f"role must be 'user' or 'assistant', got {role!r}")
        _, result = append_message(
            self.store, session_id, chat, role, text, check_ids=self._check_size
        )
        self._record_append(served, result)
        return result

    def _append(self, served: ServedSession, ids: list[int]) -> AppendResult:
        result = self.store.append(served.id, ids)
        self._record_append(served, result)
        return result

    def _record_append(self, served: ServedSession, result: AppendResult) -> None:
        served.appended_tokens += result.appended
        served.prefill_s += result.latency_s
        self.metrics.appended_tokens.inc(result.appended)
        self.metrics.append_latency.observe(result.latency_s)

    def _no_template(self, what: str) -> str:
        return (
            f"{what} need(s) a chat template, and this model's tokenizer ({self.model_name}) "
            "has none (a base model): open a session and append token ids instead "
            "(AppendTokens token_ids), or serve a chat model"
        )

    # ------------------------------------------------------------ HTTP reuse
    def render(self, messages: list[dict], owner: str | None = None) -> tuple[str, list[int]]:
        """A conversation rendered with the model's chat template, ending with the
        assistant generation prompt: its text and its token ids (a size bound from
        ``owner``'s sessions: None, all)."""
        if no_chat_template(self.tokenizer):
            raise ValueError(self._no_template("chat completions (messages)"))
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        self._check_prompt_text(text, owner)
        return text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _check_prompt_text(self, text: str, owner: str | None = None) -> None:
        """Refuse a prompt that cannot fit before tokenizing all of it: a prompt may be the
        longest open session's history plus ``max_append_tokens``, so a text with more
        tokens than that is refused as soon as a prefix shows it (tokenized in pieces).
        Only ``owner``'s sessions count: the bound never tells of another key's sessions."""
        longest = 0
        for sid in self.store.ids():
            try:
                served = self.store.metadata(sid)
                if owner is not None and getattr(served, "owner", None) != owner:
                    continue
                longest = max(longest, self.store.verifier(sid).history_len)
            except SessionError:
                pass
        bound = longest + self.limits.max_append_tokens
        if len(text.encode()) <= bound:  # a token covers at least one byte
            return
        piece, margin = 16 * 1024, 64  # a cut can split at most one token into a few
        counted = 0
        for start in range(0, len(text), piece):
            chunk = text[start : start + piece]
            counted += len(self.tokenizer(chunk, add_special_tokens=False)["input_ids"]) - margin
            if counted > bound:
                raise ValueError(
                    f"the conversation has more than {bound} tokens, more than this server's "
                    f"limit of {self.limits.max_append_tokens} new tokens in one append allows: "
                    "send a shorter conversation (or continue a session)"
                )

    def attach(
        self,
        prompt_ids: list[int],
        *,
        session_id: str | None,
        reuse: bool,
        owner: str = ANONYMOUS,
        prompt_text: str | None = None,
    ) -> Attached:
        """Bind a session of ``owner`` to an HTTP request whose conversation renders to
        ``prompt_ids`` (``prompt_text``: the rendered text, when known).

        ``session_id``: that session (explicit from now on), whose history must be a prefix
        of ``prompt_ids``. Else, with ``reuse``, the owner's idle implicit session with the
        longest history that is a prefix (then only the remainder is prefilled), or, failing
        that, whose history's text is a prefix of ``prompt_text`` (:meth:`_claim_prefix`);
        else a new implicit session. The session is marked in use until :meth:`detach`.
        """
        self.check_running()
        inputs.token_ids(prompt_ids, self.store.vocab_size, "prompt")
        self.expire_implicit()
        if session_id is not None:
            served = self.get(session_id, owner)
            self.store.claim(session_id)  # SessionInUse while another request holds it
            history = self.store.verifier(session_id).history_token_ids
            if prompt_ids[: len(history)] != history:
                self.detach(served)
                raise ValueError(
                    f"the messages do not extend session {session_id!r}'s history "
                    f"({len(history)} tokens): send the whole conversation so far plus the new turn"
                )
            served.chat = None
            served.implicit = False  # named by its client: never matched by prefix again
            return self._attach_append(served, prompt_ids, len(history), 0.0)
        match = self._claim_prefix(prompt_ids, owner, prompt_text) if reuse else None
        if match is not None:
            claimed, prompt_ids = match
            reused = len(self.store.verifier(claimed.id).history_token_ids)
            self.metrics.prefix_reuse.labels("hit").inc()
            self.metrics.reused_tokens.inc(reused)
            return self._attach_append(claimed, prompt_ids, reused, 0.0)
        self.metrics.prefix_reuse.labels("miss" if reuse else "disabled").inc()
        served, queued_s = self.create(origin="http", implicit=True, claimed=True, owner=owner)
        return self._attach_append(served, prompt_ids, 0, queued_s)

    def _claim_prefix(
        self, prompt_ids: list[int], owner: str, prompt_text: str | None = None
    ) -> tuple[ServedSession, list[int]] | None:
        """Claim ``owner``'s unclaimed implicit session with the longest history that is a
        prefix of ``prompt_ids``; with none, and ``prompt_text`` given, the one with the
        longest history whose text is a prefix of ``prompt_text``. Returns the session and
        the prompt's ids to use: ``prompt_ids``, or, for a text match, the session's
        history followed by the ids of the rest of the text (None if nothing matches).

        The text match keeps a conversation's reuse when its client sends back a reply
        whose text tokenizes to other ids than the model generated (``"\n\n"`` written
        as two ids, re-read as one): the session keeps the ids it generated, as a gRPC
        text session does, where re-tokenizing the whole conversation would not extend
        its history and would prefill all of it again."""

        def mine(metadata: object) -> bool:
            return _is_implicit(metadata) and metadata.owner == owner  # type: ignore[attr-defined]

        candidates = self.store.claim_where(mine)
        best, best_len, ids = None, -1, prompt_ids
        histories = {}
        for sid in candidates:
            try:
                histories[sid] = self.store.verifier(sid).history_token_ids
            except SessionError:
                continue
        for sid, history in histories.items():
            if best_len < len(history) <= len(prompt_ids) and prompt_ids[: len(history)] == history:
                best, best_len = sid, len(history)
        if best is None and prompt_text is not None:
            matched = ""
            for sid, history in histories.items():
                text = self.tokenizer.decode(
                    history, skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
                if len(matched) < len(text) and prompt_text.startswith(text):
                    best, matched = sid, text
            if best is not None:
                rest = self.tokenizer(prompt_text[len(matched) :], add_special_tokens=False)
                ids = histories[best] + list(rest["input_ids"])
        for sid in candidates:
            if sid != best:
                self.store.release(sid)
        if len(candidates) > (best is not None):
            self.admission.released()  # released again: evictable for a queued create
        if best is None:
            return None
        try:
            return self.get(best), ids
        except UnknownSession:  # closed meanwhile
            return None

    def _attach_append(
        self, served: ServedSession, prompt_ids: list[int], reused: int, queued_s: float
    ) -> Attached:
        new = prompt_ids[reused:]
        try:
            appended = self._append(served, self._check_size(new)) if new else None
        except BaseException:
            # a session opened for this request and left empty is closed, not leaked
            self.detach(served, close=served.implicit and served.appended_tokens == 0)
            raise
        return Attached(
            served,
            reused_tokens=reused,
            prompt_tokens=len(prompt_ids),
            appended=appended,
            queued_s=queued_s,
        )

    def detach(self, served: ServedSession, *, close: bool = False) -> None:
        """Release a session bound by :meth:`attach` (closing it for stateless requests);
        either way a queued create is woken (an idle implicit session can be evicted)."""
        self.store.release(served.id)
        if close:
            try:
                self.close(served.id)
            except UnknownSession:
                pass
        self.admission.released()

    # --------------------------------------------------------------- generate
    def check_options(self, options: GenerateOptions) -> None:
        """Validate a generation request before any state changes."""
        inputs.count(
            options.max_new_tokens,
            "max_new_tokens",
            minimum=1,
            maximum=self.limits.max_new_tokens,
            hint=f"this server's limit is {self.limits.max_new_tokens}",
        )
        inputs.count(options.draft_length, "draft_length", minimum=1, maximum=64)
        if options.stop_token_ids:
            inputs.stop_token_ids(list(options.stop_token_ids), self.store.vocab_size)
        self.check_stops(options)
        spec = options.proposer or "none"
        draft = self.proposers.resolve(spec)  # what is served, and how to load a draft model
        if spec != "none" and "+" not in spec and proposer_kind(spec.partition(":")[0]).tree:
            try:
                registry.check_tree_support(self.store.model)
            except NotImplementedError as exc:
                raise ValueError(f"proposer {options.proposer!r}: {exc}") from None
        if draft is None:  # a spec only its builder refuses fails here, before a prefill
            self.proposers.build(spec)  # (a loaded draft's were checked at startup)

    def check_stops(self, options: GenerateOptions) -> None:
        """The one place a generation's stop set is checked: with no end-of-sequence id
        (the model declares none), no ``stop_token_ids`` and no stop string, nothing but
        ``max_new_tokens`` would end it, which a client rarely means; refused unless
        ``allow_no_stop``."""
        if options.allow_no_stop or options.stop_strings:
            return
        if not (self.store.eos_token_ids or options.stop_token_ids):
            raise ValueError(
                f"the stop set is empty: {self.model_name} declares no end-of-sequence token "
                "and the request gives no stop_token_ids (or stop strings), so only "
                "max_new_tokens would end the reply; give stop_token_ids, or set "
                "allow_no_stop to generate exactly max_new_tokens tokens"
            )

    def _proposer(self, served: ServedSession, spec: str):
        """The proposer of ``spec`` for ``served``: a loaded draft model's is the session's
        own (built on first use, kept until the session closes); a model-free one is built
        per request from the session's history."""
        if self.proposers.resolve(spec) is None:
            return self.proposers.build(spec)
        with served.lock:
            proposer = served.proposers.get(spec)
        if proposer is None:
            proposer = self.proposers.build(spec)
            with served.lock:
                proposer = served.proposers.setdefault(spec, proposer)
            try:  # closed while it was built: nobody frees it later
                self.store.metadata(served.id)
            except UnknownSession:
                served.release_proposers()
                raise
        return proposer

    def generate(
        self,
        session_id: str,
        options: GenerateOptions,
        cancelled: Callable[[], bool] = lambda: False,
        owner: str | None = None,
    ) -> ServedStream:
        """The session's events for one generation (arguments checked before the first event).

        Stops before computing the next token once ``cancelled()`` is true (and before
        delivering a token computed meanwhile); raises
        :class:`ServerShuttingDown` between tokens when the server stops. On every exit the
        store stream is closed: the session keeps exactly the tokens the stream returned
        (less a retracted last one); a text session's chat template records them as the
        assistant reply.
        """
        self.check_running()
        self.check_options(options)
        served = self.get(session_id, owner)
        proposer = self._proposer(served, options.proposer or "none")
        stream = self.store.generate(
            session_id,
            options.max_new_tokens,
            options.sampling,
            stop_token_ids=list(options.stop_token_ids) or None,
            proposer=proposer,
            draft_length=options.draft_length,
            adaptive_draft_length=options.adaptive_draft_length,
            cancelled=cancelled,  # also between computing a token and delivering it
        )
        turn = ChatTurn(stream, served.chat, self.store.eos_token_ids)
        return ServedStream(self._events(served, turn, cancelled), turn)

    def _events(
        self, served: ServedSession, turn: ChatTurn, cancelled: Callable[[], bool]
    ) -> Generator[Event, None, None]:
        delivered: list[int] = []
        counted = 0  # tokens counted in the metric: only kept ones (a retracted one is not)
        end = "error"
        t0 = last = time.perf_counter()
        served.generations += 1
        with self._running_lock:
            self._running += 1
        try:
            for event in turn:
                if isinstance(event, Token):
                    now = time.perf_counter()
                    if delivered:
                        self.metrics.token_latency.observe(now - last)
                    else:
                        self.metrics.first_token_latency.observe(now - t0)
                    last = now
                    delivered.append(event.id)
                    counted = self._count_tokens(counted, len(turn.token_ids) - 1)
                elif isinstance(event, Done):
                    end = "done"
                yield event
                if end == "done":
                    break
                if cancelled():
                    end = "cancelled"
                    break
                if self.shutting_down.is_set():
                    end = "shutdown"
                    raise ServerShuttingDown(
                        f"the server is shutting down: the stream ended after {len(delivered)} tokens "
                        "(the session keeps them until the server exits)"
                    )
            if end != "done":  # the store ended it: cancelled after computing a token
                end = "cancelled"
        except GeneratorExit:
            if end != "done":  # closed right after Done: a whole stream
                end = "cancelled"
            raise
        finally:
            turn.close()  # the session keeps what was yielded; the template records it
            self._count_tokens(counted, len(turn.token_ids))
            with self._running_lock:
                self._running -= 1
            self._trim_if_idle()
            # counted once the session has settled: a client that sees the count go up
            # reads the session's final history
            self.metrics.streams_ended.labels(end).inc()

    def _count_tokens(self, counted: int, kept: int) -> int:
        """Raise the generated-tokens metric from ``counted`` to ``kept`` tokens of one
        stream; returns the new count. While a stream runs, every token but the last one
        ``next()`` returned is kept (only that one can still be retracted), so the metric
        trails by a token and never counts one the session did not keep."""
        if kept > counted:
            self.metrics.generated_tokens.inc(kept - counted)
            return kept
        return counted

    # ------------------------------------------------------------------ info
    def info(self, session_id: str, owner: str | None = None) -> dict:
        """What GetSessionInfo returns (a plain dict; ``history`` is the committed ids)."""
        served = self.get(session_id, owner)
        info = self.store.info(session_id)
        cfg = self.store.config
        verifier = self.store.verifier(session_id)
        budget_bytes = verifier.cache.kv_budget_bytes() if cfg.budget is not None else None
        spec = info.speculative
        return {
            "session_id": session_id,
            "history_len": info.history_len,
            "cache_len": info.cache_len,
            "kv_live_bytes": info.kv_live_bytes,
            "budget_tokens": cfg.budget or 0,
            "kv_budget_bytes": budget_bytes or 0,
            "turns": info.turns,
            "generated_tokens": info.generated_tokens,
            "appended_tokens": served.appended_tokens,
            "generations": served.generations,
            "prefill_s": served.prefill_s,
            "sink": cfg.sink,
            "positions": cfg.positions,
            "proposed": spec.proposed,
            "accepted": spec.accepted,
            "history": verifier.history_token_ids,
            "draft_kv_live_bytes": served.draft_cache_bytes(),
        }
