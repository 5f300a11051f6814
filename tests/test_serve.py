"""The served runtime end to end: real ``kakeya-lab serve`` subprocesses on loopback ports,
driven by real clients (grpcio stubs, the official ``openai`` client, httpx for /metrics).

Two servers per module, started in parallel: ``main`` (capacity 10, reject, a small window
so every conversation here evicts) and ``queued`` (capacity 2, queue admission; stopped
by the SIGTERM test, then restarted on the same ports). Replies are
checked against in-process :class:`SessionStore` greedy decoding of the same token ids (the
oracle) with the same cache configuration.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="needs the serve extra")
openai = pytest.importorskip("openai", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")

from conftest import Server, start_server  # noqa: E402

from kakeya_lab.backends.config import SinkWindowConfig  # noqa: E402
from kakeya_lab.chat import ChatTemplate  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL  # noqa: E402
from kakeya_lab.serve.proto import session_pb2 as pb  # noqa: E402
from kakeya_lab.session import SessionStore, Token  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SINK, WINDOW = 4, 60
CONFIG = SinkWindowConfig(sink=SINK, window=WINDOW)


@pytest.fixture(scope="module")
def servers(serve):
    """Both servers, started in parallel (the ``serve`` factory stops them): the main one
    batches its sessions' steps (the default), the queued one does not (``--no-batch``)."""
    common = ("--sink", str(SINK), "--window", str(WINDOW))
    with ThreadPoolExecutor(2) as pool:
        main = pool.submit(serve, *common, "--capacity", "10", "--admission", "reject")
        queued = pool.submit(
            serve, *common, "--capacity", "2", "--admission", "queue", "--max-wait-s", "3",
            "--no-batch",
        )  # fmt: skip
        return {"main": main.result(), "queued": queued.result()}


@pytest.fixture(scope="module")
def main_server(servers) -> Server:
    return servers["main"]


@pytest.fixture(scope="module")
def oracle(default_model):
    """In-process greedy decoding over the same cache configuration."""
    store = SessionStore(default_model.model, CONFIG, capacity=64)

    def greedy(turns: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        sid = store.create()
        replies = []
        try:
            for ids in turns:
                store.append(sid, ids)
                replies.append(
                    [e.id for e in store.generate(sid, max_new_tokens) if isinstance(e, Token)]
                )
        finally:
            store.close(sid)
        return replies

    return greedy


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ------------------------------------------------------------------------- gRPC


def test_a_fresh_servers_first_reply_runs_warm_kernels_and_moves_no_memory(main_server):
    """The server runs the fastest kernel measured here by default and says so; it has run
    one step before its ready line, so the kernels' packed weights (``exact``'s integer
    forms, over 100 MB for this model) already exist: the first client's reply leaves the
    footprint where the ready line left it (runs first in this module, on a fresh server)."""
    assert "linear auto (" in main_server.ready
    before = main_server.footprint()
    assert before["sessions"] == before["kv"] == 0
    with main_server.client() as client:
        sid = client.create()
        client.append_ids(sid, [504, 1573, 40061, 761, 288])
        assert len(client.generate(sid, 4).token_ids) == 4
        client.close_session(sid)
    main_server.assert_back_to(before)


def test_grpc_multi_turn_equals_in_process_greedy(main_server, default_model, oracle):
    tok = default_model.tokenizer
    questions = ["What is the capital of France?", "And of Italy?", "Name a river there."]
    with main_server.client() as client:
        sid = client.create(system_prompt="You are brief.")
        chat = ChatTemplate(tok, system="You are brief.")  # what the server's template does
        turns, replies, truncated = [], [], []
        for q in questions:
            appended = client.append_text(sid, q)
            turns.append(chat.user(q))
            assert appended.appended_tokens == len(turns[-1])
            reply = client.generate(sid, 12)
            chat.generated(reply.token_ids, eos_token_ids=[tok.eos_token_id])
            replies.append(reply.token_ids)
            truncated += [reply.truncated_dropped, appended.dropped_tokens]
            assert reply.done.generated_tokens == len(reply.token_ids)
        info = client.info(sid, include_history=True)
        client.close_session(sid)
    expected = oracle(turns, 12)
    assert replies == expected
    assert list(info.history) == [t for turn, r in zip(turns, replies) for t in turn + r]
    assert info.history_len > info.budget_tokens == SINK + WINDOW  # the window evicted
    assert info.cache_len == SINK + WINDOW
    assert 0 < info.kv_live_bytes <= info.kv_budget_bytes
    assert info.appended_tokens == sum(map(len, turns)) and info.generations == 3
    assert any(d is not None and d > 0 for d in truncated)  # eviction was reported


def test_grpc_served_proposers_greedy_equal_plain(main_server, default_model):
    """Every served proposer (the registry's model-free kinds, chains and trees) streams
    plain greedy decoding's tokens."""
    from kakeya_lab.serve.sessions import served_proposer_kinds

    ids = default_model.tokenizer(
        "one two three four, one two three four, one two", add_special_tokens=False
    )["input_ids"]
    proposers = ("none", *(kind.example for kind in served_proposer_kinds()))
    with main_server.client() as client:
        outputs = []
        for proposer in proposers:
            sid = client.create()
            client.append_ids(sid, ids)
            events = list(client.stream(sid, 10, proposer=proposer))
            outputs.append([e.token.id for e in events if e.WhichOneof("event") == "token"])
            steps = [e.step for e in events if e.WhichOneof("event") == "step"]
            assert bool(steps) == (proposer != "none")
            info = client.info(sid)
            assert (info.proposed > 0) == (proposer != "none"), proposer
            client.close_session(sid)
        sid = client.create()
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(sid, 4, proposer="early-exit:4")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model-free" in refused.value.details()
        assert client.info(sid).history_len == 0  # refused before any state changed
        client.close_session(sid)
    assert len(outputs[0]) > 0
    assert all(out == outputs[0] for out in outputs), dict(zip(proposers, outputs))


def test_grpc_cancel_keeps_exactly_the_sent_tokens(main_server, default_model, oracle):
    story = (
        "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
        "out loud as his father had taught him. At the top he"
    )
    ids = default_model.tokenizer(story, add_special_tokens=False)[
        "input_ids"
    ]  # prose: no early EOS
    with main_server.client() as client:
        sid = client.create()
        client.append_ids(sid, ids)
        call = client.stream(sid, 200)
        received = []
        for event in call:
            if event.WhichOneof("event") == "token":
                received.append(event.token.id)
                if len(received) == 3:
                    call.cancel()
                    break
        assert call.code() is grpc.StatusCode.CANCELLED
        # generation stopped at once: the session is free again within a token or two
        deadline = time.monotonic() + 10
        while True:
            try:
                more = client.generate(sid, 4).token_ids
                break
            except grpc.RpcError as exc:
                if (
                    exc.code() is not grpc.StatusCode.FAILED_PRECONDITION
                    or time.monotonic() > deadline
                ):
                    raise
                time.sleep(0.1)
        after = client.info(sid, include_history=True)
        tail = list(after.history)[len(ids) :]
        assert tail[-len(more) :] == more
        kept = tail[: -len(more)]
        # the session holds the tokens the server sent: the client's 3 and at most the one or
        # two in flight when it cancelled; never the 200 asked for
        assert kept[:3] == received and 3 <= len(kept) <= 5
        client.close_session(sid)
    assert tail == oracle([ids], len(tail))[0]


def test_grpc_bad_input_is_refused_and_changes_nothing(main_server):
    with main_server.client() as client:
        sid = client.create()
        code, msg = _code(lambda: client.generate(sid, 4))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "append" in msg  # empty session
        client.append_ids(sid, [1, 2, 3])
        before = client.info(sid, include_history=True)
        bad = {
            "out of vocabulary": lambda: client.append_ids(sid, [5, 49152]),
            "negative id": lambda: client.append_ids(sid, [-1]),
            "empty": lambda: client.append_ids(sid, []),
            "oversized": lambda: client.append_ids(sid, [7] * 9000),
            "text in token mode": lambda: client.append_text(sid, "hello"),
            "max_new_tokens 0": lambda: client.generate(sid, 0),
            "max_new_tokens too large": lambda: client.generate(sid, 10**6),
            "unserved proposer": lambda: client.generate(sid, 4, proposer="draft:other"),
            "stop id out of vocabulary": lambda: client.generate(sid, 4, stop_token_ids=[10**7]),
            "negative temperature": lambda: client.generate(sid, 4, temperature=-1.0),
        }
        for name, call in bad.items():
            code, msg = _code(call)
            assert code is grpc.StatusCode.INVALID_ARGUMENT, (name, code, msg)
            assert msg, name
        after = client.info(sid, include_history=True)
        assert list(after.history) == list(before.history) and after.turns == before.turns

        stream = client.stream(sid, 50)
        next(iter(stream))  # the stream is open
        code, msg = _code(lambda: client.append_ids(sid, [4]))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "stream" in msg
        stream.cancel()

        code, msg = _code(lambda: client.info("0123456789abcdef"))
        assert code is grpc.StatusCode.NOT_FOUND and "unknown session" in msg
        time.sleep(0.5)
        client.close_session(sid)
        for call in (
            lambda: client.info(sid),
            lambda: client.append_ids(sid, [1]),
            lambda: client.generate(sid, 2),
            lambda: client.close_session(sid),
        ):
            code, msg = _code(call)
            assert code is grpc.StatusCode.NOT_FOUND and "closed" in msg


def test_capacity_reject(main_server):
    """Fill every slot with gRPC sessions (idle HTTP sessions are evicted first): the next
    create is RESOURCE_EXHAUSTED exactly when all 10 slots hold gRPC sessions."""
    with main_server.client() as client:
        created = []
        try:
            for _ in range(11):
                try:
                    created.append(client.create())
                except grpc.RpcError as exc:
                    assert (
                        exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                        and "session slot" in exc.details()
                    )
                    break
            else:
                pytest.fail("11 creates on a capacity-10 server all succeeded")
            assert main_server.metrics()["kakeya_sessions_open"] == 10
            assert main_server.metrics()["kakeya_admission_total{outcome=rejected}"] >= 1
            with pytest.raises(openai.RateLimitError):  # HTTP: 429
                main_server.openai().chat.completions.create(
                    model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
        finally:
            for sid in created:
                client.close_session(sid)


# ------------------------------------------------------------------------- HTTP


def test_openai_client_streaming_and_prefix_reuse(main_server, default_model):
    oc = main_server.openai()
    http = httpx.Client(base_url=main_server.http_base, timeout=60)
    assert [m.id for m in oc.models.list().data] == [DEFAULT_MODEL]
    assert http.get("/health").json()["status"] == "ok"
    messages = [{"role": "user", "content": "Give me one word for happy."}]
    first = oc.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=8)
    sid = first.model_extra["session_id"]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].message.content and first.usage.completion_tokens > 0
    reuse_before = main_server.metrics().get("kakeya_prefix_reuse_total{result=hit}", 0)

    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And one for sad?"},
    ]
    chunks = list(
        oc.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = chunks[-1]
    ext = last.model_extra["kakeya"]
    # the second request reused the first's session: only the new turn was prefilled
    assert ext["session_id"] == sid
    assert last.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens
    assert ext["appended_tokens"] == last.usage.prompt_tokens - first.usage.total_tokens
    assert main_server.metrics()["kakeya_prefix_reuse_total{result=hit}"] == reuse_before + 1
    info = http.get(f"/v1/sessions/{sid}").json()
    assert info["appended_tokens"] == first.usage.prompt_tokens + ext["appended_tokens"]
    assert info["history_len"] == last.usage.prompt_tokens + last.usage.completion_tokens

    # the stateless arm (reuse off) prefills everything and leaves no session behind
    open_before = main_server.metrics()["kakeya_sessions_open"]
    stateless = oc.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=8, extra_body={"reuse": False}
    )
    assert stateless.usage.prompt_tokens_details.cached_tokens == 0
    assert stateless.model_extra["kakeya"]["appended_tokens"] == stateless.usage.prompt_tokens
    assert stateless.choices[0].message.content == streamed  # same greedy reply either way
    assert main_server.metrics()["kakeya_sessions_open"] == open_before

    # an explicit session id continues that session
    messages += [{"role": "assistant", "content": streamed}, {"role": "user", "content": "Thanks!"}]
    pinned = oc.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=4, extra_body={"session_id": sid}
    )
    assert pinned.model_extra["session_id"] == sid
    assert pinned.usage.prompt_tokens_details.cached_tokens == last.usage.total_tokens
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    http.close()


def test_http_errors(main_server):
    oc = main_server.openai()
    http = httpx.Client(base_url=main_server.http_base, timeout=60)
    user = [{"role": "user", "content": "hi"}]
    bad_json = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    for body in (
        {},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": user, "n": 2},
        {"messages": user, "max_tokens": 10**6},
        {"messages": user, "stop_token_ids": [10**7]},
    ):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
    unknown_model = http.post("/v1/chat/completions", json={"messages": user, "model": "other"})
    assert unknown_model.status_code == 404 and unknown_model.json()["error"]["param"] == "model"
    open_before = main_server.metrics()["kakeya_sessions_open"]
    too_many_tokens = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 9000}]}
    )
    assert (
        too_many_tokens.status_code == 400 and "limit" in too_many_tokens.json()["error"]["message"]
    )
    huge = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 9_000_000}]}
    )
    assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
    assert main_server.metrics()["kakeya_sessions_open"] == open_before  # nothing left behind
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=user,
            max_tokens=2,
            extra_body={"session_id": "0123456789abcdef"},
        )
    first = oc.chat.completions.create(model=DEFAULT_MODEL, messages=user, max_tokens=2)
    sid = first.model_extra["session_id"]
    before = http.get(f"/v1/sessions/{sid}").json()["history"]
    with pytest.raises(openai.BadRequestError, match="do not extend"):
        oc.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "other"}],
            max_tokens=2,
            extra_body={"session_id": sid},
        )
    assert http.get(f"/v1/sessions/{sid}").json()["history"] == before
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    assert http.delete(f"/v1/sessions/{sid}").status_code == 404
    http.close()


def test_http_disconnect_mid_stream_stops_generation(main_server):
    http = httpx.Client(base_url=main_server.http_base, timeout=60)
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 200,
        "stream": True,
    }
    cancelled_before = main_server.cancelled_streams()
    sid, pieces = None, 0
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            sid = chunk["session_id"]
            pieces += bool(chunk["choices"][0]["delta"].get("content"))
            if pieces == 3:
                break  # leaving the block closes the connection
    # the server notices the disconnect and closes the stream (its tokens are then committed)
    main_server.wait_cancelled(cancelled_before)
    info = http.get(f"/v1/sessions/{sid}").json()
    time.sleep(0.5)
    again = http.get(f"/v1/sessions/{sid}").json()
    assert again["history_len"] == info["history_len"]  # generation has stopped
    generated = again["generated_tokens"]
    assert 3 <= generated < 200 and again["history_len"] == again["appended_tokens"] + generated
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    http.close()


# ------------------------------------------------------------------- load, faults


def test_concurrent_sessions_with_faults_equal_a_clean_run(main_server, default_model, oracle):
    """8 sessions x 2 turns at once while another client injects faults; every session's
    replies equal in-process greedy decoding (the clean run)."""
    tok = default_model.tokenizer
    conversations = [
        [
            tok(f"Session {i}, turn {t}: count to {i + t}.", add_special_tokens=False)["input_ids"]
            for t in range(2)
        ]
        for i in range(8)
    ]

    def run(turns: list[list[int]]) -> list[list[int]]:
        with main_server.client() as client:
            sid = client.create()
            replies: list[list[int]] = []
            for ids in turns:
                client.append_ids(sid, ids)
                replies.append(client.generate(sid, 4).token_ids)
            client.close_session(sid)
            return replies

    before = main_server.metrics()
    stop = threading.Event()
    faults: list[str] = []

    def inject() -> None:
        with main_server.client() as client:
            while not stop.is_set():
                sid = client.create()
                for call in (
                    lambda s=sid: client.append_ids(s, [49152]),
                    lambda s=sid: client.append_ids(s, []),
                    lambda: client.info("ffffffffffffffff"),
                ):
                    try:
                        call()
                    except grpc.RpcError as exc:
                        faults.append(exc.code().name)
                client.append_ids(sid, [1, 2, 3])
                call = client.stream(sid, 50)
                next(iter(call))
                call.cancel()  # a client killed mid-stream
                time.sleep(0.2)
                client.close_session(sid)

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            served = list(pool.map(run, conversations))
    finally:
        stop.set()
        injector.join(timeout=60)
    assert faults and set(faults) <= {"INVALID_ARGUMENT", "NOT_FOUND"}
    for turns, replies in zip(conversations, served):
        assert replies == oracle(turns, 4)
    after = main_server.metrics()
    assert after["kakeya_streams_total{end=cancelled}"] > before.get(
        "kakeya_streams_total{end=cancelled}", 0
    )
    # nothing leaks: no session left open (idle HTTP sessions may have been evicted for room)
    assert after["kakeya_sessions_open"] <= before["kakeya_sessions_open"]
    assert after["kakeya_kv_live_bytes"] <= before["kakeya_kv_live_bytes"]


def test_batched_steps_are_the_default_and_no_batch_turns_them_off(servers, oracle):
    assert "batched steps on" in servers["main"].ready
    assert "batched steps off" in servers["queued"].ready
    turns = [[504, 1573, 40061, 761, 288], [16380, 260, 24224]]
    for server in servers.values():  # both reply as in-process greedy decoding
        with server.client() as client:
            sid = client.create()
            replies = []
            for ids in turns:
                client.append_ids(sid, ids)
                replies.append(client.generate(sid, 6).token_ids)
            client.close_session(sid)
        assert replies == oracle(turns, 6)


def test_queue_admission_waits_for_a_slot_then_gives_up(servers):
    queued = servers["queued"]
    with queued.client() as client:
        other, holder = client.create(), client.create()  # both slots taken
        result: dict = {}

        def wait_for_slot() -> None:
            t0 = time.monotonic()
            reply = client.stub.CreateSession(pb.CreateSessionRequest(), timeout=30)
            result.update(
                sid=reply.session_id, queued_s=reply.queued_s, waited=time.monotonic() - t0
            )

        waiter = threading.Thread(target=wait_for_slot)
        waiter.start()
        time.sleep(1.0)
        assert "sid" not in result  # still queued
        client.close_session(holder)
        waiter.join(timeout=10)
        # woken by the release, not by its 30 s deadline (a generous bound for a busy machine)
        assert result["queued_s"] >= 0.8 and result["waited"] < 15
        t0 = time.monotonic()
        code, msg = _code(client.create)  # the slot is taken: wait 3 s, then give up
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in msg
        assert 2.5 <= time.monotonic() - t0 < 10
        with pytest.raises(openai.RateLimitError):
            queued.openai().chat.completions.create(
                model=DEFAULT_MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
        client.close_session(result["sid"])
        client.close_session(other)


def test_sigterm_ends_active_streams_then_restart_reports_sessions_gone(servers):
    """SIGTERM while a gRPC stream and an HTTP stream are active: the gRPC call ends
    UNAVAILABLE, the SSE stream with an in-band 503 error event, and the process exits 0.
    A server restarted on the same ports reports the old session unknown."""
    queued = servers["queued"]
    chunks: list[dict] = []
    http_started = threading.Event()

    def http_stream() -> None:
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 500,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{queued.http_base}/v1/chat/completions", json=body, timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    http_started.set()

    with queued.client() as client:
        sid = client.create()
        client.append_ids(sid, [1, 2, 3, 4])
        reader = threading.Thread(target=http_stream)
        reader.start()
        assert http_started.wait(timeout=60)
        call = client.stream(sid, 500)
        received = 0
        with pytest.raises(grpc.RpcError) as info:
            for event in call:
                received += event.WhichOneof("event") == "token"
                if received == 2:
                    queued.proc.send_signal(signal.SIGTERM)
        reader.join(timeout=30)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.details() and received < 500
    assert chunks[-1].get("error", {}).get("code") == 503, chunks[-1]
    assert "shutting down" in chunks[-1]["error"]["message"]
    assert queued.proc.wait(timeout=30) == 0
    assert any("stopped" in line for line in queued.stderr)

    # restarted on the same ports, the server reports the old session id unknown (never a
    # silently reset session)
    grpc_port = queued.grpc_target.rsplit(":", 1)[1]
    http_port = queued.http_base.rsplit(":", 1)[1]
    restarted = start_server(
        "--sink",
        str(SINK),
        "--window",
        str(WINDOW),
        "--capacity",
        "2",
        "--grpc-port",
        grpc_port,
        "--http-port",
        http_port,
    )
    try:
        assert restarted.grpc_target == queued.grpc_target
        with restarted.client() as client:
            code, msg = _code(lambda: client.info(sid))
            assert code is grpc.StatusCode.NOT_FOUND and "unknown session" in msg
        assert httpx.get(f"{restarted.http_base}/v1/sessions/{sid}", timeout=30).status_code == 404
    finally:
        restarted.stop()


def test_cli_refuses_bad_arguments_before_loading_the_model(tmp_path, monkeypatch, capsys):
    from kakeya_lab.cli import main

    monkeypatch.setenv(
        "KAKEYA_LAB_HOME", str(tmp_path)
    )  # an empty store: loading would fail differently
    cases = {
        "--capacity": ["--capacity", "0"],
        "--grpc-port": ["--grpc-port", "70000"],
        "--host": ["--host", "localhost:1"],
        "window": ["--window", "0"],
        "--max-wait-s": ["--max-wait-s", "-1"],
        "different ports": ["--grpc-port", "9000", "--http-port", "9000"],
        "--draft takes one draft model": ["--draft", "ngram"],
        "no-such-model": ["--draft", "draft:no-such-model:int4"],
        "no named drafter 'nope'": ["--draft", "drafter:nope"],
        "drafter:NAME (it serves drafter-tree:NAME too)": ["--draft", "drafter-tree:nope"],
        "needs a --draft": ["--draft-window", "8"],
        "--batch runs on the torch backend only": ["--backend", "mlx", "--batch"],
    }
    for needle, args in cases.items():
        assert main(["serve", *args]) == 2, args
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and needle in err, (args, err)
    assert not any(tmp_path.iterdir())


def test_served_long_run_arms(main_server):
    """The three client-driven arms over the same turns: session-bound gRPC and reusing HTTP
    prefill only each turn's new tokens; stateless HTTP re-prefills a growing history."""
    from kakeya_lab.bench.aggregate import aggregate_arm
    from kakeya_lab.bench.long_run.served import run_served_long_run

    turns = ["Hi! What is your name?", "Tell me about the sea.", "And about mountains?"]
    df = run_served_long_run(
        main_server.grpc_target, main_server.http_base, turns, max_new_tokens=6
    )
    by = {arm: g.sort_values("turn") for arm, g in df.groupby("arm")}
    grpc_s, reuse, stateless = by["grpc_session"], by["http_reuse"], by["http_stateless"]
    assert (stateless["cached_tokens"] == 0).all()
    assert stateless["appended_tokens"].is_monotonic_increasing  # the whole history, every turn
    assert (reuse["cached_tokens"].iloc[1:] > 0).all()
    assert (
        reuse["appended_tokens"].iloc[1:].values < stateless["appended_tokens"].iloc[1:].values
    ).all()
    assert (
        grpc_s["appended_tokens"].iloc[1:].values < stateless["appended_tokens"].iloc[1:].values
    ).all()
    assert list(reuse["reply"]) == list(stateless["reply"])  # same prompt ids, same greedy reply
    assert (df["kv_live_bytes"] > 0).all() and (df["rss_bytes"] > 0).all()
    for g in by.values():
        summary = aggregate_arm(
            g, budget_tokens=SINK + WINDOW, budget_bytes=None, turns_per_bucket=1
        )
        assert summary["turns"] == len(turns)
