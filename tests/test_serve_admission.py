"""Admission as the reference defines it: ``queue`` with ``max_wait_s`` 0 waits without
limit (``reject`` fails at once), queued creations are woken by whatever frees a slot
(a close, an eviction, an idle expiry, whichever call ran it) and refused at shutdown.

In-process (fast loop): the serving layer over a real store of the tiny random model,
waiters on real threads. Real servers (slow): a waiter with ``--max-wait-s 0`` gets the
slot when another session closes; one is woken by an idle expiry; waiters over gRPC and
HTTP are refused promptly (``UNAVAILABLE`` / 503) when the server is stopped.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.serve.admission import Admission, AdmissionRejected, ServerShuttingDown
from kakeya_lab.serve.sessions import ServedSessions
from kakeya_lab.session import SessionStore

CONFIG = SinkWindowConfig(sink=4, window=28)
BOUND_S = 20.0  # a generous bound on "promptly" for a busy 2-core machine


def _served(tiny_model, *, policy="queue", max_wait_s=0.0, idle_ttl_s=None) -> ServedSessions:
    store = SessionStore(tiny_model.model, CONFIG, capacity=1, idle_ttl_s=idle_ttl_s)
    admission = Admission(policy, max_wait_s, max_waiting=4)  # type: ignore[arg-type]
    return ServedSessions(store, tiny_model.tokenizer, admission, implicit_ttl_s=None)


class Waiter(threading.Thread):
    """A creation on its own thread: ``result`` (session, queued_s) or ``error``."""

    def __init__(self, served: ServedSessions):
        super().__init__(daemon=True)
        self.served = served
        self.result: tuple | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            self.result = self.served.create(origin="grpc")
        except BaseException as exc:
            self.error = exc
        self.ended_at = time.monotonic()

    def queued(self) -> None:
        """Wait until it is counted as queued."""
        deadline = time.monotonic() + BOUND_S
        while self.served.admission.waiting < 1:
            assert time.monotonic() < deadline and self.is_alive(), self.error
            time.sleep(0.01)


def test_queue_with_max_wait_0_waits_without_limit_and_reject_fails_at_once(tiny_model):
    served = _served(tiny_model, policy="reject", max_wait_s=0)
    served.create(origin="grpc")
    with pytest.raises(AdmissionRejected, match="policy 'reject'"):
        served.create(origin="grpc")
    served = _served(tiny_model)  # queue, max_wait_s 0
    holder, _ = served.create(origin="grpc")
    waiter = Waiter(served)
    waiter.start()
    waiter.queued()
    time.sleep(1.5)  # before, max_wait_s 0 refused at once: it still waits
    assert waiter.is_alive() and waiter.result is None and waiter.error is None
    served.close(holder.id)
    waiter.join(BOUND_S)
    assert waiter.result is not None and waiter.result[1] >= 1.5


def test_a_drop_by_any_call_wakes_a_waiter(tiny_model):
    """The store closing the session itself (not through the serving layer's close, which
    used to be the only path that woke waiters) frees the slot for a waiter at once."""
    served = _served(tiny_model, max_wait_s=60)  # a deadline past BOUND_S
    holder, _ = served.create(origin="grpc")
    waiter = Waiter(served)
    waiter.start()
    waiter.queued()
    t0 = time.monotonic()
    served.store.close(holder.id)
    waiter.join(BOUND_S)
    assert waiter.result is not None and waiter.ended_at is not None
    assert waiter.ended_at - t0 < BOUND_S


def test_an_idle_expiry_wakes_a_waiter_when_it_is_due(tiny_model):
    """An abandoned session's idle TTL frees its slot with no call at all: the waiter
    sleeps until the expiry is due (no periodic look) and takes the slot then."""
    ttl = 1.5
    served = _served(tiny_model, max_wait_s=60, idle_ttl_s=ttl)  # a deadline past BOUND_S
    served.create(origin="grpc")  # abandoned
    due = served.next_expiry_s()
    assert due is not None
    waiter = Waiter(served)
    waiter.start()
    waiter.join(BOUND_S)
    assert waiter.result is not None and waiter.ended_at is not None
    assert due <= waiter.ended_at < due + BOUND_S  # at the expiry, not the 60 s deadline
    assert waiter.result[1] > 0  # it queued


def test_shutdown_refuses_waiters_and_later_callers(tiny_model):
    served = _served(tiny_model)
    served.create(origin="grpc")
    waiters = [Waiter(served) for _ in range(2)]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + BOUND_S
    while served.admission.waiting < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    served.shutdown()
    for w in waiters:
        w.join(BOUND_S)
        assert isinstance(w.error, ServerShuttingDown) and "shutting down" in str(w.error)
        assert w.ended_at is not None and w.ended_at - t0 < BOUND_S
    with pytest.raises(ServerShuttingDown):
        served.create(origin="grpc")
    assert served.admission.waiting == 0


# ---------------------------------------------------------------- real servers


@pytest.mark.slow
def test_served_waiters_get_the_slot_on_close_and_expiry_and_are_refused_at_shutdown(serve):
    grpc = pytest.importorskip("grpc", reason="needs the serve extra")
    httpx = pytest.importorskip("httpx", reason="needs the serve extra")
    from kakeya_lab.serve.proto import session_pb2 as pb

    common = ("--sink", "4", "--window", "60", "--capacity", "1", "--admission", "queue")
    server = serve(*common, "--max-wait-s", "0", "--idle-ttl-s", "4", "--implicit-ttl-s", "0")
    with server.client() as client:
        # a close: the waiter (max wait 0 = no limit) gets the slot
        holder = client.create()
        call = client.stub.CreateSession.future(pb.CreateSessionRequest(), timeout=120)
        time.sleep(2.0)
        assert not call.done()  # before, max-wait-s 0 refused at once
        client.close_session(holder)
        reply = call.result(timeout=BOUND_S)
        # the server's clock starts when the request reaches it, a little after the client
        # sent it and began its 2 s sleep (CI once saw 1.998 s)
        assert reply.queued_s >= 1.9
        # an idle expiry: the abandoned session (idle TTL 4 s) frees the slot on its own
        t0 = time.monotonic()
        second = client.stub.CreateSession(pb.CreateSessionRequest(), timeout=120)
        waited = time.monotonic() - t0
        assert 1.0 <= second.queued_s and waited < 4 + BOUND_S
        with pytest.raises(grpc.RpcError):
            client.info(reply.session_id)  # expired
        # shutdown: a gRPC and an HTTP waiter are refused promptly with a clear status
        call = client.stub.CreateSession.future(pb.CreateSessionRequest(), timeout=120)
        http_reply: dict = {}

        def http_create() -> None:
            r = httpx.post(f"{server.http_base}/v1/sessions", timeout=120)
            http_reply.update(status=r.status_code, body=r.json(), at=time.monotonic())

        http_waiter = threading.Thread(target=http_create)
        http_waiter.start()
        deadline = time.monotonic() + BOUND_S
        while server.metrics().get("kakeya_admission_waiting", 0) < 2:
            assert time.monotonic() < deadline, "two waiters"
            time.sleep(0.05)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as refused:
            call.result(timeout=BOUND_S)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        assert time.monotonic() - t0 < BOUND_S
        http_waiter.join(BOUND_S)
    assert http_reply["status"] == 503, http_reply
    error = http_reply["body"]["error"]
    assert error["code"] == 503 and "shutting down" in error["message"], json.dumps(error)
    assert http_reply["at"] - t0 < BOUND_S
    assert server.proc.wait(timeout=60) == 0
