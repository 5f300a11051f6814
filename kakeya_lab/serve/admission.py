"""Admission control for served sessions: what ``create`` does when every slot is taken.

``reject`` fails at once (:class:`AdmissionRejected`: gRPC ``RESOURCE_EXHAUSTED``, HTTP 429);
``queue`` waits for a slot to free: up to ``max_wait_s`` and then fails the same way, or,
with ``max_wait_s`` 0, without limit (the reference engine's meaning of 0).

A waiting caller holds its server thread, so the queue is bounded: at most ``max_waiting``
callers wait at once (fewer than the gRPC server's worker threads and the HTTP thread
pool's), and the next one is refused at once with a clear message, so queued admissions
can never starve unrelated calls (info, close, generate) of threads.

Waking: every release of a slot (:meth:`Admission.released`: a close, an eviction, an idle
expiry, whoever ran it, a stateless session going idle) wakes the waiters, and each
retries the store. An idle TTL frees a slot without any call, so a waiter also sleeps no
longer than until the next expiry is due (``next_expiry``: when the earliest idle session
expires) and then retries, which runs that expiry. At shutdown (:meth:`Admission.shutdown`)
every waiter is refused with :class:`ServerShuttingDown` (gRPC ``UNAVAILABLE``, HTTP 503)
instead of hanging, and so is every later caller.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from kakeya_lab.session import CapacityExceeded

AdmissionPolicy = Literal["reject", "queue"]
T = TypeVar("T")

# the shortest sleep of a waiter whose next expiry is already due but did not free a slot
# (a session computing an event is never expired): retries stay cheap, never a busy loop
MIN_RETRY_S = 0.05


class AdmissionRejected(Exception):
    """No session slot (policy ``reject``, a full queue, or ``queue`` after ``max_wait_s``)."""


class ServerShuttingDown(Exception):
    """The server is stopping: streams end, queued and new work is refused."""


class Admission:
    """Runs a slot-taking call under a policy; :meth:`released` wakes queued callers and
    :meth:`shutdown` refuses them."""

    def __init__(
        self,
        policy: AdmissionPolicy = "reject",
        max_wait_s: float = 0.0,
        *,
        max_waiting: int = 8,
        next_expiry: Callable[[], float | None] | None = None,
    ):
        """``max_wait_s``: the longest wait of policy ``queue`` (0: no limit; ignored by
        ``reject``); ``max_waiting``: callers waiting at once; ``next_expiry``: the
        ``time.monotonic()`` at which an idle TTL next frees a slot on its own (None: none
        due), so a waiter retries then."""
        if policy not in ("reject", "queue"):
            raise ValueError(f"admission policy must be 'reject' or 'queue', got {policy!r}")
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0 (0: wait without limit), got {max_wait_s}")
        if not (isinstance(max_waiting, int) and max_waiting >= 0):
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.policy = policy
        self.max_wait_s = float(max_wait_s)
        self.max_waiting = max_waiting
        self.next_expiry = next_expiry
        self._freed = threading.Condition()
        self._releases = 0  # counts released() calls: a wake-up between try and wait is kept
        self._closed = False
        self.waiting = 0

    def _wait_limit(self) -> float:
        """Seconds a caller may wait: 0 for ``reject``, infinite for ``queue`` with 0."""
        if self.policy == "reject":
            return 0.0
        return self.max_wait_s if self.max_wait_s > 0 else math.inf

    def _check_open(self) -> None:
        if self._closed:
            raise ServerShuttingDown(
                "the server is shutting down: no session slot will free; retry on a running server"
            )

    def admit(
        self, take_slot: Callable[[], T], cancelled: Callable[[], bool] = lambda: False
    ) -> tuple[T, float]:
        """Call ``take_slot`` until it does not raise :class:`CapacityExceeded`; return its
        value and the seconds spent queued (0.0 exactly when it did not wait). A caller
        that went away (``cancelled()``, checked at every wake-up; call :meth:`released` to
        wake it) stops waiting with :class:`AdmissionRejected`; after :meth:`shutdown`,
        :class:`ServerShuttingDown`."""
        t0 = time.monotonic()
        deadline = t0 + self._wait_limit()
        waited = False  # counted in ``waiting`` from its first wait until it returns
        try:
            while True:
                if cancelled():
                    raise AdmissionRejected("the caller went away while queued for a session slot")
                with self._freed:
                    self._check_open()
                    seen = self._releases
                try:
                    value = take_slot()
                    return value, (time.monotonic() - t0) if waited else 0.0
                except CapacityExceeded as exc:
                    reason = exc
                with self._freed:
                    self._check_open()
                    if deadline - time.monotonic() <= 0:
                        how = (
                            "policy 'reject'"
                            if self.policy == "reject"
                            else f"queued {time.monotonic() - t0:.1f}s"
                        )
                        raise AdmissionRejected(
                            f"no free session slot ({how}): {reason}; close a session or retry later"
                        )
                    if not waited:
                        if self.waiting >= self.max_waiting:
                            raise AdmissionRejected(
                                f"no free session slot and the admission queue is full "
                                f"({self.waiting} requests already wait): {reason}; close a "
                                "session or retry later"
                            )
                        waited = True
                        self.waiting += 1
                    self._sleep(seen, deadline)
        finally:
            if waited:
                with self._freed:
                    self.waiting -= 1

    def _sleep(self, seen: int, deadline: float) -> None:
        """Under the condition: wait for a release, a shutdown, the deadline or the next
        idle expiry, whichever comes first."""
        due = self.next_expiry() if self.next_expiry is not None else None
        if due is not None:
            due = max(due, time.monotonic() + MIN_RETRY_S)
        while self._releases == seen and not self._closed:
            until = deadline if due is None else min(deadline, due)
            left = until - time.monotonic()
            if left <= 0:
                return
            # Condition.wait cannot take an infinite timeout; a day is as good
            self._freed.wait(timeout=min(left, 86400.0))

    def released(self) -> None:
        """A slot may have freed: wake the queued callers."""
        with self._freed:
            self._releases += 1
            self._freed.notify_all()

    def shutdown(self) -> None:
        """Refuse the queued callers (now) and every later one with :class:`ServerShuttingDown`."""
        with self._freed:
            self._closed = True
            self._freed.notify_all()
