"""The stream of one ``generate`` call: an iterator of events that commits exactly what it
handed out (docs/design.md, "Sessions").

Each ``next()`` holds the session's lock only while computing the event, never across the
hand-out; ``close()`` (or dropping the last reference) runs the body's cleanup, which
settles the delivered tokens and rolls the rest of the step back. A session dropped by the
store (close, eviction, idle expiry) ends its stream with :class:`SessionClosed` at the
consumer's next ``next()``.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator

from kakeya_lab.session.errors import SessionClosed
from kakeya_lab.session.events import Event
from kakeya_lab.session.state import SessionState


class GenerationStream(Iterator[Event]):
    """The events of one ``generate`` call (an iterator; also a context manager).

    ``close()`` stops it: the session keeps exactly the tokens already handed out as
    :class:`~kakeya_lab.session.events.Token` events. Dropping the last reference closes it
    too. Each ``next()`` holds the session's lock only while computing the event.
    """

    def __init__(self, session: SessionState, body: Generator[Event, None, None]):
        self._session = session
        self._body = body
        self._finished = False

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> Event:
        session = self._session
        with session.lock:
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
                return next(self._body)
            except BaseException:
                self._end()
                raise
            finally:
                session.computing -= 1
                session.last_used_s = session.last_seen_s = time.monotonic()

    def close(self) -> None:
        """Stop the stream; keep exactly the delivered tokens. Idempotent."""
        session = self._session
        with session.lock:
            if self._finished:
                return
            try:
                self._body.close()  # runs the body's cleanup: settle the delivered tokens
            finally:
                self._end()

    def _end(self) -> None:
        self._finished = True
        self._body.close()  # no-op once finished or closed
        if self._session.open_stream() in (self, None):
            self._session.stream = None

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finaliser; the session stays consistent
            pass
