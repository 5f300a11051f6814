"""The stream of one ``generate`` call: an iterator of events that commits exactly what it
handed out (docs/design.md, "Sessions" and "Interrupts").

Each ``next()`` holds the session's lock only while computing the event, never across the
hand-out; ``close()`` (or dropping the last reference) runs the body's cleanup, which
settles the delivered tokens and rolls the rest of the step back. A session dropped by the
store (close, eviction, idle expiry) ends its stream with :class:`SessionClosed` at the
consumer's next ``next()``.

The hand-off of a token: the body *offers* a :class:`Token` (the decoder has not delivered
it). The token counts as received when ``next()`` returns it, and as not received when
``next()`` raises, wherever the exception (a ``KeyboardInterrupt``) struck. ``next()``
records only that fact, with one attribute store at the start of its exception handler
(no interrupt can be raised before it); the token is delivered to the decoder (committed)
at the stream's next ``next()``/``close()``/end, with SIGINT deferred, unless that record
says it was lost. So a token is committed iff ``next()`` returned it, unless the consumer
retracts it (:meth:`~GenerationStream.retract`) before the stream moves on: a consumer
that passes tokens on (a server writing them to a connection) learns only later whether
the last one reached its own consumer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator

from kakeya_lab.backends.seam import interrupts_deferred
from kakeya_lab.session.errors import SessionClosed
from kakeya_lab.session.events import Event, Token
from kakeya_lab.session.state import SessionState


class GenerationStream(Iterator[Event]):
    """The events of one ``generate`` call (an iterator; also a context manager).

    ``close()`` stops it: the session keeps exactly the tokens already handed out as
    :class:`~kakeya_lab.session.events.Token` events (``next()`` returned them), also when
    a ``next()`` was interrupted part-way. Dropping the last reference closes it too. Each
    ``next()`` holds the session's lock only while computing the event. ``body`` yields the
    events, each :class:`Token` offered but not delivered; ``deliver()`` delivers the
    offered token to the decoder and returns it (called with the session's lock held,
    SIGINT deferred). ``token_ids``: the tokens delivered so far.
    """

    def __init__(
        self,
        session: SessionState,
        body: Generator[Event, None, None],
        deliver: Callable[[], int],
    ):
        self._session = session
        self._body = body
        self._deliver = deliver
        self._finished = False
        self._calls = 0  # next() calls so far
        self._handed = 0  # the call whose Token may be with the consumer, not yet delivered
        self._lost = 0  # the last call that raised: its Token never reached the consumer
        self.token_ids: list[int] = []  # the tokens delivered (a last one may follow at the end)

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> Event:
        call = self._calls = self._calls + 1
        try:
            return self._next(call)
        except BaseException:
            # First in the handler: nothing checks for interrupts before this store.
            self._lost = call
            self._end()
            raise

    def _next(self, call: int) -> Event:
        session = self._session
        with session.lock:
            self._confirm()
            if self._finished:
                raise StopIteration
            if session.closed_reason is not None:
                self._end()
                raise SessionClosed(
                    f"session {session.id!r} was {session.closed_reason} while generating; "
                    "the stream has ended (the session no longer exists: create a new one)"
                )
            session.computing += 1
            try:
                event = next(self._body)
                if isinstance(event, Token):
                    self._handed = call
                return event
            finally:
                session.computing -= 1
                session.last_used_s = session.last_seen_s = time.monotonic()

    def _confirm(self) -> None:
        """Deliver the token of the last hand-off if it reached the consumer (idempotent;
        under the session's lock)."""
        if self._handed:
            with interrupts_deferred():
                if self._handed and self._handed != self._lost:
                    self.token_ids.append(self._deliver())
                self._handed = 0

    def retract(self) -> bool:
        """The token the last ``next()`` returned did not reach the consumer's own consumer
        after all (a server could not send it): it is not delivered. Call it before the
        next ``next()`` or ``close()``; the next ``next()`` offers that token again. Returns
        whether there was such a token (False after any other event or a second call)."""
        with self._session.lock:
            if not self._handed or self._handed == self._lost:
                return False
            self._lost = self._handed
            return True

    def close(self) -> None:
        """Stop the stream; keep exactly the delivered tokens. Idempotent."""
        with self._session.lock:
            self._end()

    def _end(self) -> None:
        """Deliver the last handed-out token, then run the body's cleanup (idempotent)."""
        session = self._session
        with session.lock:
            self._confirm()
            self._finished = True
            self._body.close()  # settles the delivered tokens; no-op once finished or closed
            if session.open_stream() in (self, None):
                session.stream = None

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finaliser; the session stays consistent
            pass
