"""Served sessions under pressure, against real ``kakeya-lab serve`` subprocesses driven by
grpcio (the project's client and raw stubs), the ``openai`` client and httpx:

* ``queue`` (capacity 1, queue admission, long wait): queued creations hold a bounded
  number of server threads, so unrelated calls still answer; a stateless HTTP session
  going idle wakes a queued creation;
* ``ttl`` (capacity 1, queue, short idle TTLs): an expired session wakes a queued creation,
  implicit sessions expire on their own TTL;
* ``lru`` (capacity 1, ``evict_lru``): a streaming session is never evicted; evictions are
  counted as evictions;
* ``main`` (capacity 4, a user's proposer kind that only its builder checks): a bad spec
  changes nothing; the session is released before the last gRPC message.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="needs the serve extra")
openai = pytest.importorskip("openai", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")

from conftest import Server  # noqa: E402

from kakeya_lab.models import DEFAULT_MODEL  # noqa: E402
from kakeya_lab.serve.proto import session_pb2 as pb  # noqa: E402

pytestmark = pytest.mark.slow

PICKY = Path(__file__).with_name("proposer_checked_by_builder.py")
COMMON = ("--sink", "4", "--window", "60")
USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def servers(serve) -> dict[str, Server]:
    """The four servers, started two at a time (the ``serve`` factory stops them)."""
    configs = {
        # no TTL: only a release can wake a waiter (no periodic look)
        "queue": (
            *("--capacity", "1", "--admission", "queue", "--max-wait-s", "60"),
            *("--implicit-ttl-s", "0"),
        ),
        "ttl": (
            *("--capacity", "1", "--admission", "queue", "--max-wait-s", "60"),
            *("--idle-ttl-s", "2", "--implicit-ttl-s", "1"),
        ),
        "lru": ("--capacity", "1", "--admission", "evict_lru"),
        "main": ("--capacity", "4", "--proposer-module", str(PICKY)),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(serve, *COMMON, *args) for name, args in configs.items()}
        return {name: f.result() for name, f in futures.items()}


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _waiting(server: Server) -> float:
    return server.metrics().get("kakeya_admission_waiting", 0.0)


# ---------------------------------------------------------------------- queueing


def test_queued_creations_leave_threads_for_other_calls(servers):
    """40 CreateSession calls against a full queue-admission server (60 s wait): at most
    ``--max-queued`` (8) wait and the rest are refused at once with a clear message, so an
    unrelated GetSessionInfo answers while the queue is full (before, 32 waiting calls took
    every gRPC worker thread and it waited for the queue's 60 s). A close admits a waiter;
    waiters whose clients gave up leave at once and leak no session."""
    server = servers["queue"]
    with server.client() as client:
        holder = client.create()
        calls = [
            client.stub.CreateSession.future(pb.CreateSessionRequest(), timeout=90)
            for _ in range(40)
        ]
        admitted = None
        try:
            _wait_for(lambda: _waiting(server) >= 8, "8 queued creations")
            info = client.stub.GetSessionInfo(pb.SessionInfoRequest(session_id=holder), timeout=20)
            assert info.session_id == holder
            _wait_for(lambda: sum(c.done() for c in calls) == 32, "32 refused creations", 20)
            refused = [c for c in calls if c.done()]
            assert _waiting(server) == 8
            for call in refused:
                assert call.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "admission queue is full" in call.details()
            client.close_session(holder)  # wakes the waiters: one gets the slot
            holder = None
            _wait_for(lambda: sum(c.done() for c in calls) == 33, "an admitted waiter", 20)
            admitted = next(c for c in calls if c.done() and c not in refused)
            assert admitted.code() is grpc.StatusCode.OK
        finally:  # leave no waiter behind for the next test
            for call in calls:
                call.cancel()
            _wait_for(lambda: _waiting(server) == 0, "the cancelled waiters to leave", 20)
            ok = admitted is not None and admitted.code() is grpc.StatusCode.OK
            for sid in (holder, admitted.result().session_id if ok else None):  # type: ignore[union-attr]
                if sid is not None:
                    client.close_session(sid)
        assert server.metrics()["kakeya_sessions_open"] == 0


def test_a_stateless_session_going_idle_wakes_a_queued_creation(servers):
    """A streamed stateless chat holds the only slot; a gRPC CreateSession queues. When the
    stream ends its implicit session is idle (evictable): the waiter gets the slot at once,
    not after the queue's 60 s (before, nothing woke it)."""
    server = servers["queue"]
    oc = server.openai()
    stream = oc.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=USER,
        max_tokens=6,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = iter(stream)
    next(chunks)  # the stream is open: its session is held
    with server.client() as client:
        call = client.stub.CreateSession.future(pb.CreateSessionRequest(), timeout=90)
        _wait_for(lambda: _waiting(server) == 1, "the queued creation")
        rest = list(chunks)
        assert rest and rest[-1].choices[0].finish_reason is not None
        t0 = time.monotonic()
        sid = call.result(timeout=30).session_id
        assert time.monotonic() - t0 < 30
        client.close_session(sid)


def test_an_expired_session_wakes_a_queued_creation_and_implicit_sessions_expire(servers):
    """``ttl`` server: an abandoned gRPC session (idle TTL 2 s) stops locking out a queued
    creation within about its TTL (before, nobody woke the waiter: it waited the queue's
    60 s); a stateless request's implicit session closes on its own 1 s TTL."""
    server = servers["ttl"]
    with server.client() as client:
        client.create()  # abandoned: never used again
        t0 = time.monotonic()
        sid = client.stub.CreateSession(pb.CreateSessionRequest(), timeout=30).session_id
        assert time.monotonic() - t0 < 30
        client.close_session(sid)
    reply = server.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=USER,
        max_tokens=2,  # type: ignore[arg-type]
    )
    assert reply.model_extra["session_id"]
    _wait_for(lambda: server.metrics()["kakeya_sessions_open"] == 0, "the implicit expiry")
    assert server.metrics()["kakeya_sessions_closed_total{reason=expired_implicit}"] == 1


# ---------------------------------------------------------------------- eviction


def test_evict_lru_never_evicts_a_streaming_session_and_counts_evictions(servers):
    """``lru`` server (capacity 1): while the only session streams, a new session is
    refused (RESOURCE_EXHAUSTED) and the stream completes (before, the stream's session was
    evicted mid-stream). Once idle, it is evicted for the next creation, which the metrics
    count as an eviction, not as "queued"."""
    server = servers["lru"]
    with server.client() as client:
        streaming = client.create()
        client.append_text(streaming, "Tell me a long story about the sea.")
        events = client.stream(streaming, 120)
        first = next(events)
        assert first.WhichOneof("event") in ("token", "truncated")
        with pytest.raises(grpc.RpcError) as refused:
            client.create()
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        rest = list(events)
        assert rest[-1].WhichOneof("event") == "done"
        tokens = [e for e in [first, *rest] if e.WhichOneof("event") == "token"]
        assert client.info(streaming).generated_tokens == len(tokens)
        before = server.metrics()
        fresh = client.create()  # evicts the idle session
        after = server.metrics()
        with pytest.raises(grpc.RpcError) as gone:
            client.info(streaming)
        assert gone.value.code() is grpc.StatusCode.NOT_FOUND
        key = "kakeya_admission_total{outcome=%s}"
        assert after.get(key % "evicted", 0) == before.get(key % "evicted", 0) + 1
        assert after.get(key % "queued", 0) == before.get(key % "queued", 0)
        closed = "kakeya_sessions_closed_total{reason=evicted_lru}"
        assert after[closed] == before.get(closed, 0) + 1
        client.close_session(fresh)


# ---------------------------------------------------------------- bad specs, release


def test_a_spec_only_its_builder_refuses_changes_nothing(servers):
    """``picky:bad`` passes the grammar and is refused by its builder: over HTTP (a named
    session, a stateless request) and gRPC the request fails with 400 / INVALID_ARGUMENT
    and no session is created or prefilled (before, HTTP prefilled the prompt first)."""
    server = servers["main"]
    http = httpx.Client(base_url=server.http_base, timeout=60)
    oc = server.openai()
    sid = http.post("/v1/sessions").json()["session_id"]
    open_before = server.metrics()["kakeya_sessions_open"]
    for extra in ({"session_id": sid, "proposer": "picky:bad"}, {"proposer": "picky:bad"}):
        with pytest.raises(openai.BadRequestError) as bad:
            oc.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=USER,  # type: ignore[arg-type]
                max_tokens=2,
                extra_body=extra,
            )
        assert "picky takes only the argument 'ok'" in str(bad.value)
    assert http.get(f"/v1/sessions/{sid}").json()["history_len"] == 0
    assert server.metrics()["kakeya_sessions_open"] == open_before
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    with server.client() as client:
        sid = client.create()
        client.append_text(sid, "hello")
        history = client.info(sid).history_len
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(sid, 2, proposer="picky:bad")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "picky takes only the argument 'ok'" in refused.value.details()
        assert client.info(sid).history_len == history
        ok = client.generate(sid, 2, proposer="picky:ok")
        assert len(ok.token_ids) == 2
        client.close_session(sid)
    http.close()


def test_grpc_session_is_released_before_the_last_message(servers):
    """Right after a Generate stream's ``done`` message arrives (its iterator not yet
    exhausted), the next Generate on the same session succeeds: 20 times, never busy
    (before, the session was released only after the last message was sent)."""
    server = servers["main"]
    with server.client() as client:
        sid = client.create()
        client.append_text(sid, "Count to ten.")
        busy = 0
        for _ in range(20):
            stream = client.stream(sid, 2)
            for event in stream:
                if event.WhichOneof("event") == "done":
                    break
            try:
                again = client.stream(sid, 1)
                assert [e.WhichOneof("event") for e in again][-1] == "done"
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.FAILED_PRECONDITION, exc
                busy += 1
            stream.cancel()
        assert busy == 0
        assert server.metrics()["kakeya_streams_total{end=done}"] >= 40
        client.close_session(sid)
