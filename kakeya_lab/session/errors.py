"""Errors of the session runtime (docs/design.md, "Sessions").

Every error the store raises about a session's state is a :class:`SessionError`; bad input
is refused earlier by :mod:`kakeya_lab.inputs` (``ValueError`` / ``InputTypeError``).
"""

from __future__ import annotations


class SessionError(Exception):
    """Base class of session-store errors."""


class UnknownSession(SessionError, KeyError):
    """The id names no open session (never created, closed, or evicted)."""

    def __str__(self) -> str:  # KeyError quotes its argument; say it plainly
        return str(self.args[0])


class CapacityExceeded(SessionError):
    """``create`` under the ``reject`` policy with every slot in use."""


class SessionBusy(SessionError):
    """The session has an open generation stream; finish or ``close()`` it first."""


class SessionInUse(SessionError):
    """Another caller has claimed the session (:meth:`SessionStore.claim`); retry after it
    releases it."""


class SessionClosed(SessionError):
    """The session was closed, evicted or expired while its stream was open."""
