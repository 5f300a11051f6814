"""Admission control for served sessions: what ``create`` does when every slot is taken.

``reject`` fails at once (:class:`AdmissionRejected`: gRPC ``RESOURCE_EXHAUSTED``, HTTP 429);
``queue`` waits up to ``max_wait_s`` for a slot to free (a session closed) and then fails
the same way. Waiters are woken in no particular order; each retries the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from kakeya_lab.session import CapacityExceeded

AdmissionPolicy = Literal["reject", "queue"]
T = TypeVar("T")


class AdmissionRejected(Exception):
    """No session slot (policy ``reject``, or ``queue`` after ``max_wait_s``)."""


@dataclass(frozen=True)
class AdmissionResult:
    value: object
    queued_s: float


class Admission:
    """Runs a slot-taking call under a policy; :meth:`released` wakes queued callers."""

    def __init__(self, policy: AdmissionPolicy = "reject", max_wait_s: float = 0.0):
        if policy not in ("reject", "queue"):
            raise ValueError(f"admission policy must be 'reject' or 'queue', got {policy!r}")
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.policy = policy
        self.max_wait_s = float(max_wait_s)
        self._freed = threading.Condition()
        self.waiting = 0

    def admit(self, take_slot: Callable[[], T]) -> tuple[T, float]:
        """Call ``take_slot`` until it does not raise :class:`CapacityExceeded`; return its
        value and the seconds spent queued."""
        t0 = time.monotonic()
        deadline = t0 + (self.max_wait_s if self.policy == "queue" else 0.0)
        while True:
            with self._freed:
                try:
                    return take_slot(), time.monotonic() - t0
                except CapacityExceeded as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        waited = time.monotonic() - t0
                        how = (
                            "policy 'reject'"
                            if self.policy == "reject"
                            else f"queued {waited:.1f}s"
                        )
                        raise AdmissionRejected(
                            f"no free session slot ({how}): {exc}; close a session or retry later"
                        ) from None
                    self.waiting += 1
                    try:
                        self._freed.wait(timeout=left)
                    finally:
                        self.waiting -= 1

    def released(self) -> None:
        """A slot may have freed: wake the queued callers."""
        with self._freed:
            self._freed.notify_all()
