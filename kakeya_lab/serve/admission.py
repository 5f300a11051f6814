"""Admission control for served sessions: what ``create`` does when every slot is taken.

``reject`` fails at once (:class:`AdmissionRejected`: gRPC ``RESOURCE_EXHAUSTED``, HTTP 429);
``queue`` waits up to ``max_wait_s`` for a slot to free and then fails the same way.

A waiting caller holds its server thread, so the queue is bounded: at most ``max_waiting``
callers wait at once (fewer than the gRPC server's worker threads and the HTTP thread
pool's), and the next one is refused at once with a clear message, so queued admissions
can never starve unrelated calls (info, close, generate) of threads. Every release of a
slot (:meth:`Admission.released`: a close, an eviction, a stateless session going idle)
wakes the waiters; while idle TTLs are in force they also look again every
``recheck_s``, since an expiry happens without any call. Each retries the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal, TypeVar

from kakeya_lab.session import CapacityExceeded

AdmissionPolicy = Literal["reject", "queue"]
T = TypeVar("T")


class AdmissionRejected(Exception):
    """No session slot (policy ``reject``, a full queue, or ``queue`` after ``max_wait_s``)."""


class Admission:
    """Runs a slot-taking call under a policy; :meth:`released` wakes queued callers."""

    def __init__(
        self,
        policy: AdmissionPolicy = "reject",
        max_wait_s: float = 0.0,
        *,
        max_waiting: int = 8,
        recheck_s: float | None = None,
    ):
        if policy not in ("reject", "queue"):
            raise ValueError(f"admission policy must be 'reject' or 'queue', got {policy!r}")
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if not (isinstance(max_waiting, int) and max_waiting >= 0):
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        if recheck_s is not None and not recheck_s > 0:
            raise ValueError(f"recheck_s must be > 0, got {recheck_s}")
        self.policy = policy
        self.max_wait_s = float(max_wait_s)
        self.max_waiting = max_waiting
        self.recheck_s = recheck_s
        self._freed = threading.Condition()
        self._releases = 0  # counts released() calls: a wake-up between try and wait is kept
        self.waiting = 0

    def admit(
        self, take_slot: Callable[[], T], cancelled: Callable[[], bool] = lambda: False
    ) -> tuple[T, float]:
        """Call ``take_slot`` until it does not raise :class:`CapacityExceeded`; return its
        value and the seconds spent queued (0.0 exactly when it did not wait). A caller
        that went away (``cancelled()``, checked at every wake-up; call :meth:`released` to
        wake it) stops waiting with :class:`AdmissionRejected`."""
        t0 = time.monotonic()
        deadline = t0 + (self.max_wait_s if self.policy == "queue" else 0.0)
        waited = False  # counted in ``waiting`` from its first wait until it returns
        try:
            while True:
                if cancelled():
                    raise AdmissionRejected("the caller went away while queued for a session slot")
                with self._freed:
                    seen = self._releases
                try:
                    value = take_slot()
                    return value, (time.monotonic() - t0) if waited else 0.0
                except CapacityExceeded as exc:
                    reason = exc
                with self._freed:
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
                    while self._releases == seen:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        step = left if self.recheck_s is None else min(left, self.recheck_s)
                        if not self._freed.wait(timeout=step) and self.recheck_s is not None:
                            break  # look again: an idle TTL may have freed a slot
        finally:
            if waited:
                with self._freed:
                    self.waiting -= 1

    def released(self) -> None:
        """A slot may have freed: wake the queued callers."""
        with self._freed:
            self._releases += 1
            self._freed.notify_all()
