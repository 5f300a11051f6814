"""The OpenAI-compatible HTTP surface of a real ``kakeya-lab serve`` (default model,
loopback), driven by the official ``openai`` client and httpx: the session is free the
moment a client reads ``[DONE]``, body and token limits hold while reading and tokenizing,
a cancelled stream keeps exactly the tokens sent, ``stop`` strings, and OpenAI error
objects (with the matching ``openai`` exception classes) on every error path.

The pure logic (stop matching, refused fields) runs in the fast loop. Two servers per module, started in parallel: ``server`` (capacity 8) for everything but
the capacity test, which has its own ``full`` server (capacity ``CLIENTS``, reject) so no
other test's sessions can take its slots.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")
h11 = pytest.importorskip("h11", reason="needs the serve extra (uvicorn's HTTP/1.1)")

from conftest import Server  # noqa: E402

from kakeya_lab.models import DEFAULT_MODEL  # noqa: E402
from kakeya_lab.serve.openai_protocol import ChatCompletionRequest, InvalidParam  # noqa: E402
from kakeya_lab.serve.stop_strings import StopMatcher  # noqa: E402

slow = pytest.mark.slow  # the tests with servers; the pure logic runs in the fast loop

SINK, WINDOW = 4, 60
MAX_BODY_BYTES = 8 * 2**20  # the server's default body limit
CLIENTS = 6  # concurrent stateless clients at --capacity CLIENTS
STORY = "Tell me a long story about an old lighthouse keeper and the sea."
HAPPY = [{"role": "user", "content": "Give me one word for happy."}]


@pytest.fixture(scope="module")
def servers(serve) -> dict[str, Server]:
    common = ("--sink", str(SINK), "--window", str(WINDOW), "--admission", "reject")
    with ThreadPoolExecutor(2) as pool:
        main = pool.submit(serve, *common, "--capacity", "8")
        full = pool.submit(serve, *common, "--capacity", str(CLIENTS))
        return {"main": main.result(), "full": full.result()}


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers["main"]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.http_base, timeout=120) as client:
        yield client


def _open(server: Server) -> float:
    return server.metrics()["kakeya_sessions_open"]


def _rss_bytes(server: Server) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


def _stream_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# ------------------------------------------------------------ release before [DONE]


@slow
def test_explicit_session_is_free_when_the_client_reads_done(server, http):
    """Three clients, each 20 streamed turns back to back on its own session with the
    official client, which sends the next turn as soon as it reads [DONE]: never 409 (the
    session is released before [DONE] is sent), then a non-streamed turn at once."""
    sids = [http.post("/v1/sessions").json()["session_id"] for _ in range(3)]

    def client(sid: str) -> None:
        oc = server.openai()
        messages = list(HAPPY)
        for turn in range(20):
            stream = oc.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=messages,
                max_tokens=1,
                stream=True,
                extra_body={"session_id": sid},
            )
            reply = _stream_text(stream)  # ends at [DONE]; ConflictError if still held
            assert reply, turn
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"And another one, number {turn}?"},
            ]
        whole = oc.chat.completions.create(
            model=DEFAULT_MODEL, messages=messages, max_tokens=1, extra_body={"session_id": sid}
        )
        assert whole.model_extra["session_id"] == sid

    try:
        with ThreadPoolExecutor(len(sids)) as pool:
            list(pool.map(client, sids))  # a 409 raises here
    finally:
        for sid in sids:
            http.delete(f"/v1/sessions/{sid}")


@slow
def test_concurrent_stateless_clients_at_capacity_reuse_their_sessions(servers):
    """CLIENTS stateless clients (whole conversation each turn, prefix reuse) at
    --capacity CLIENTS: no 429, every later turn reuses its own session, none orphaned."""
    full = servers["full"]
    assert _open(full) == 0
    turns = 5

    def client(i: int) -> tuple[list[int], set[str]]:
        oc = full.openai()
        messages = [{"role": "user", "content": f"Give me one word for happy, number {i}."}]
        cached, sids = [], set()
        for turn in range(turns):
            chunks = list(
                oc.chat.completions.create(
                    model=DEFAULT_MODEL,
                    messages=messages,
                    max_tokens=1,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            cached.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
            sids.add(chunks[-1].model_extra["session_id"])
            messages += [
                {"role": "assistant", "content": _stream_text(chunks)},
                {"role": "user", "content": f"Another one, {turn}?"},
            ]
        return cached, sids

    results: list[tuple[list[int], set[str]]] = []
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(client, range(CLIENTS)))  # a 429 raises here
        for cached, sids in results:
            assert cached[0] == 0 and all(c > 0 for c in cached[1:]), results
            assert len(sids) == 1, results  # every turn on the client's own session
        assert _open(full) == CLIENTS  # one session per client, none orphaned
    finally:
        with httpx.Client(base_url=full.http_base, timeout=60) as http:
            for _, sids in results:
                for sid in sids:
                    http.delete(f"/v1/sessions/{sid}")


# ------------------------------------------------------------------------- limits


def _chunked_body(total_bytes: int, piece: int = 64 * 1024):
    """A chat request of about ``total_bytes``, sent as a generator (chunked transfer: no
    Content-Length for the server to check up front)."""
    yield b'{"messages": [{"role": "user", "content": "'
    sent = 0
    while sent < total_bytes:
        yield b"x" * piece
        sent += piece
    yield b'"}]}'


@slow
def test_chunked_body_over_the_limit_is_refused_while_reading(server, http):
    """A 24 MB chunked body (three times the 8 MiB limit): 413 as an OpenAI error object,
    the server holding at most the limit (it used to parse and tokenize the whole body:
    +1.2 GB and 25 s for 12 MB); nothing left open."""
    open_before, rss_before = _open(server), _rss_bytes(server)
    r = http.post(
        "/v1/chat/completions",
        content=_chunked_body(24 * 10**6),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413, r.text[:200]
    error = r.json()["error"]
    assert "limit" in error["message"] and error["code"] == 413 and "param" in error
    grown = _rss_bytes(server) - rss_before
    assert grown < 2 * MAX_BODY_BYTES, f"server RSS grew by {grown / 1e6:.1f} MB for a refused body"
    assert _open(server) == open_before
    assert http.get("/health").json()["status"] == "ok"


@slow
def test_long_prompt_is_refused_before_it_is_all_tokenized(server, http):
    """A 6 MB prompt under the body limit but far over the token limit: 400 with the limit,
    found from a prefix of the text (tokenizing all of it took seconds and ~GB)."""
    open_before, rss_before = _open(server), _rss_bytes(server)
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "word " * 1_200_000}]},
    )
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"], r.text[:300]
    grown = _rss_bytes(server) - rss_before
    assert grown < 200 * 10**6, f"server RSS grew by {grown / 1e6:.1f} MB for a refused prompt"
    assert _open(server) == open_before


# ------------------------------------------------------------------- cancellation


def _stream_then_hang_up(http_base: str, body: dict, k: int) -> list[str]:
    """POST a streamed completion over a raw socket; after ``k`` content chunks, shut the
    sending side (the server sees the client leave) and read on until the server closes.
    Returns the text of every content chunk that arrived: all the server wrote before it
    saw the close (a client that closes outright cannot know what crossed its close)."""
    host, port = http_base.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[
            ("Host", f"{host}:{port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
        ],
    )
    received: list[str] = []
    buffer, half_closed = "", False
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(conn.send(request) + conn.send(h11.Data(data=payload)))
        sock.sendall(conn.send(h11.EndOfMessage()))
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:  # closed mid-body, as it should
                break
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
                continue
            if isinstance(event, h11.Response):
                assert event.status_code == 200, event
            elif isinstance(event, h11.Data):
                buffer += event.data.decode()
                *events, buffer = buffer.split("\n\n")
                for sse in events:
                    if sse.startswith("data: {"):
                        delta = json.loads(sse[6:])["choices"][0]["delta"].get("content")
                        if delta:
                            received.append(delta)
                if len(received) >= k and not half_closed:
                    sock.shutdown(socket.SHUT_WR)
                    half_closed = True
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                raise AssertionError(f"the whole reply came ({len(received)} chunks)")
    return received


@slow
def test_cancelled_stream_keeps_exactly_the_tokens_sent(server, http, default_model):
    """A client that hangs up after k content chunks, for several k: the session holds the
    prompt plus exactly the tokens whose text the server sent before it saw the client
    leave (the client reads on after shutting its side, so it receives all of them), past
    eviction (the prompt alone is longer than sink + window); the server's generated-tokens
    metric counts exactly those tokens (not one it took back)."""
    for k in (1, 2, 4, 7):
        sid = http.post("/v1/sessions").json()["session_id"]
        cancelled = server.cancelled_streams()
        counted = server.metrics()["kakeya_generated_tokens_total"]
        body = {
            "messages": [{"role": "user", "content": " ".join([STORY] * 5)}],
            "max_tokens": 200,
            "stream": True,
            "session_id": sid,
        }
        received = _stream_then_hang_up(server.http_base, body, k)
        server.wait_cancelled(cancelled)
        info = http.get(f"/v1/sessions/{sid}").json()
        tail = info["history"][info["appended_tokens"] :]
        assert info["history_len"] > SINK + WINDOW >= info["cache_len"]  # evicted
        assert k <= len(received) < 200, (k, received)
        assert info["generated_tokens"] == len(tail) == len(received), (k, received, tail)
        assert default_model.tokenizer.decode(tail) == "".join(received)
        assert server.metrics()["kakeya_generated_tokens_total"] - counted == len(tail)
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200


# ------------------------------------------------------------------- stop strings


@slow
def test_stop_strings_end_the_reply_before_the_stop_text(server, http, default_model):
    """Greedy reply first, then the same request with a stop string from its middle:
    content is the reply up to (excluding) the stop string, streamed and not; the session
    keeps the tokens up to the one that completed the stop string."""
    oc = server.openai()
    tok = default_model.tokenizer
    messages = [{"role": "user", "content": STORY}]
    sid = http.post("/v1/sessions").json()["session_id"]
    plain = oc.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=40, extra_body={"session_id": sid}
    )
    reply = plain.choices[0].message.content
    info = http.get(f"/v1/sessions/{sid}").json()
    reply_ids = info["history"][info["appended_tokens"] :]
    http.delete(f"/v1/sessions/{sid}")
    words = reply.split()
    stop = " " + words[len(words) // 2] + " " + words[len(words) // 2 + 1]
    assert stop in reply and len(words) > 6, reply
    expected = reply[: reply.index(stop)]
    # tokens kept: up to the one whose text completes the stop string
    kept = next(n for n in range(1, len(reply_ids) + 1) if stop in tok.decode(reply_ids[:n]))

    for stops in (stop, ["never appears 123", stop]):
        sid = http.post("/v1/sessions").json()["session_id"]
        whole = oc.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=messages,
            max_tokens=40,
            stop=stops,
            extra_body={"session_id": sid},
        )
        assert whole.choices[0].message.content == expected
        assert whole.choices[0].finish_reason == "stop"
        assert whole.usage.completion_tokens == kept
        info = http.get(f"/v1/sessions/{sid}").json()
        assert info["history"][info["appended_tokens"] :] == reply_ids[:kept]
        http.delete(f"/v1/sessions/{sid}")

        chunks = list(
            oc.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=messages,
                max_tokens=40,
                stop=stops,
                stream=True,
                extra_body={"reuse": False},
            )
        )
        assert _stream_text(chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert not any(stop in (c.choices[0].delta.content or "") for c in chunks if c.choices)

    # a stop string that never appears changes nothing
    other = oc.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=messages,
        max_tokens=40,
        stop=["never appears 123"],
        extra_body={"reuse": False},
    )
    assert other.choices[0].message.content == reply
    assert other.choices[0].finish_reason == plain.choices[0].finish_reason


# ------------------------------------------------------------------------- errors


def _assert_error_object(body: dict, status: int) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["message"] and error["code"] == status, body
    return error


@slow
def test_every_error_is_an_openai_error_object(server, http):
    oc = server.openai()
    user = [{"role": "user", "content": "hi"}]
    open_before = _open(server)
    # the official client raises the class of each status
    refused = {
        "logprobs": {"logprobs": True},
        "top_logprobs": {"top_logprobs": 2},
        "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        "response_format": {"response_format": {"type": "json_object"}},
        "n": {"n": 2},
        "max_tokens": {"max_tokens": 0},
        "max_completion_tokens": {"max_completion_tokens": 0},
        "stop": {"stop": ["a", "b", "c", "d", "e"]},
    }
    for param, fields in refused.items():
        with pytest.raises(openai.BadRequestError) as info:
            oc.chat.completions.create(model=DEFAULT_MODEL, messages=user, **fields)
        error = _assert_error_object(info.value.response.json(), 400)
        assert error["param"] == param, error
        assert param in error["message"], error
    # plain text is still allowed, and so is a request without the refused fields
    ok = oc.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=user,
        max_tokens=1,
        response_format={"type": "text"},
        extra_body={"reuse": False},
    )
    assert ok.choices[0].message.content is not None

    with pytest.raises(openai.NotFoundError) as info:
        oc.chat.completions.create(model="no-such-model", messages=user, max_tokens=1)
    assert _assert_error_object(info.value.response.json(), 404)["param"] == "model"
    assert oc.models.retrieve(DEFAULT_MODEL).id == DEFAULT_MODEL
    with pytest.raises(openai.NotFoundError):
        oc.models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError) as info:
        oc.get("/no/such/route", cast_to=object)
    _assert_error_object(info.value.response.json(), 404)
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(
            model=DEFAULT_MODEL, messages=user, max_tokens=1, extra_body={"session_id": "0" * 16}
        )

    # raw HTTP: unparseable bodies, wrong methods, unknown routes and sessions, too large
    cases = [
        (http.post("/v1/chat/completions", content=b"{not json"), 400),
        (
            http.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={"content-type": "application/json"},
            ),
            400,
        ),
        (http.post("/v1/chat/completions", json={"messages": "hi"}), 400),
        (http.get("/v1/chat/completions"), 405),
        (http.post("/v1/models"), 405),
        (http.get("/v2/anything"), 404),
        (http.get("/v1/sessions/0123456789abcdef"), 404),
        (http.delete("/v1/sessions/0123456789abcdef"), 404),
        (http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 9_000_000}]}), 413),
    ]  # fmt: skip
    for response, status in cases:
        assert response.status_code == status, (response.request.url, response.text[:200])
        _assert_error_object(response.json(), status)
    assert _open(server) == open_before  # nothing left behind by any refusal


@slow
def test_busy_and_full_map_to_conflict_and_rate_limit_errors(servers):
    """409 while another request holds the session, 429 when no slot is free: OpenAI error
    objects, raised by the official client as ConflictError and RateLimitError."""
    main, full = servers["main"], servers["full"]
    with httpx.Client(base_url=main.http_base, timeout=120) as http:
        sid = http.post("/v1/sessions").json()["session_id"]
        body = {
            "messages": [{"role": "user", "content": STORY}],
            "max_tokens": 200,
            "stream": True,
            "session_id": sid,
        }
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                # keep the line iterator: dropping it would close the response (a disconnect,
                # which ends the stream and frees the session)
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                with pytest.raises(openai.ConflictError) as info:
                    main.openai().chat.completions.create(
                        model=DEFAULT_MODEL, messages=HAPPY, extra_body={"session_id": sid}
                    )
                _assert_error_object(info.value.response.json(), 409)
        finally:
            http.delete(f"/v1/sessions/{sid}")
    with httpx.Client(base_url=full.http_base, timeout=120) as http:
        held = [http.post("/v1/sessions").json()["session_id"] for _ in range(CLIENTS)]
        try:
            with pytest.raises(openai.RateLimitError) as info:
                full.openai().chat.completions.create(
                    model=DEFAULT_MODEL, messages=HAPPY, extra_body={"reuse": False}
                )  # (with reuse, an empty open session would be taken)
            _assert_error_object(info.value.response.json(), 429)
            r = http.post("/v1/sessions")
            assert r.status_code == 429
            _assert_error_object(r.json(), 429)
        finally:
            for sid in held:
                http.delete(f"/v1/sessions/{sid}")


# ------------------------------------------------------------------ pure logic


def _match(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops)
    out = [matcher.feed(p) for p in pieces]
    if not matcher.stopped:
        out.append(matcher.flush())
    return out, matcher.stopped


def test_stop_matcher_holds_back_a_possible_stop_and_cuts_before_it():
    assert _match(["END"], ["abc E", "N", "D more"]) == (["abc ", "", ""], True)
    assert _match(["END"], ["abc E", "ND"]) == (["abc ", ""], True)
    assert _match(["xyz"], ["ax", "b"]) == (["a", "xb", ""], False)  # not a stop after all
    assert _match(["xyz"], ["ax"]) == (["a", "x"], False)  # the held tail, flushed
    assert _match(["b c", "c"], ["a b", " c d"]) == (["a ", ""], True)  # the earliest wins
    assert _match([], ["one ", "two"]) == (["one ", "two", ""], False)
    with pytest.raises(ValueError):
        StopMatcher([""])


def test_stop_matcher_equals_cutting_the_text_where_a_stop_first_appears():
    """For random texts, stops and splits: the shown text is the text so far, cut before
    its earliest stop string, at the first delta after which the text holds one (the
    generation ends there); all of it when none appears."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 3))) for _ in range(2)]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        expected, hit = text, False
        for end in [*cuts, len(text)]:
            found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
            if found:
                expected, hit = text[: min(found)], True
                break
        out, stopped = _match(stops, pieces)
        assert "".join(out) == expected and stopped == hit, (text, stops, pieces, out)


def test_request_fields_that_are_not_implemented_are_refused_by_name():
    user = [{"role": "user", "content": "hi"}]
    for param, value in [
        ("logprobs", True),
        ("top_logprobs", 1),
        ("tools", []),
        ("tool_choice", "auto"),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("response_format", {"type": "json_object"}),
        ("n", 2),
    ]:
        req = ChatCompletionRequest(messages=user, **{param: value})
        with pytest.raises(InvalidParam) as info:
            req.refuse_unsupported()
        assert info.value.param == param
    ChatCompletionRequest(messages=user, response_format={"type": "text"}, logprobs=False)
    for param in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(InvalidParam, match=param):
            ChatCompletionRequest(messages=user, **{param: 0}).max_new_tokens()
    assert ChatCompletionRequest(messages=user, max_tokens=3).max_new_tokens() == 3
    assert ChatCompletionRequest(messages=user).max_new_tokens() == 256
    with pytest.raises(InvalidParam, match="at most 4"):
        ChatCompletionRequest(messages=user, stop=list("abcde")).stop_strings()
    assert ChatCompletionRequest(messages=user, stop="x").stop_strings() == ["x"]


def test_store_stream_drops_a_token_computed_after_cancel(tiny_model):
    """The engine half of the cancel fix: ``cancelled`` is asked after a token is computed
    and before it is delivered, so a token computed while the client left is not kept;
    generation then continues exactly as an uninterrupted run."""
    from kakeya_lab.backends.config import SinkWindowConfig
    from kakeya_lab.session import Done, SessionStore, Token

    store = SessionStore(tiny_model.model, SinkWindowConfig(sink=4, window=24), capacity=2)
    prompt = list(range(5, 45))
    ref = store.create()
    store.append(ref, prompt)
    full = [e.id for e in store.generate(ref, 10) if isinstance(e, Token)]
    sid = store.create()
    store.append(sid, prompt)
    left = [False]
    got, events = [], []
    for event in store.generate(sid, 10, cancelled=lambda: left[0]):
        events.append(event)
        if isinstance(event, Token):
            got.append(event.id)
            left[0] = len(got) == 3  # the client leaves while the 4th token is computed
    assert got == full[:3] and not any(isinstance(e, Done) for e in events)
    assert store.verifier(sid).history_token_ids == prompt + full[:3]
    assert store.info(sid).generated_tokens == 3
    rest = [e.id for e in store.generate(sid, 7) if isinstance(e, Token)]
    assert got + rest == full


@slow
def test_reuse_survives_a_reply_whose_text_tokenizes_to_other_ids(server, http, default_model):
    """A client sends back the reply's text, and that text tokenizes to other ids than the
    model generated (greedy "List three fruits." cut at 16 tokens ends in "\\n\\n1", written
    as ids that re-tokenize differently): the next request still reuses the session,
    keeping the ids the model generated, instead of prefilling the whole conversation; its
    reply, decoded past the cache's sink + window, is greedy decoding of exactly those ids."""
    tok = default_model.tokenizer
    first = [{"role": "user", "content": "List three fruits."}]
    r1 = http.post("/v1/chat/completions", json={"messages": first, "max_tokens": 16})
    assert r1.status_code == 200, r1.text
    sid, reply = r1.json()["session_id"], r1.json()["choices"][0]["message"]["content"]
    history = http.get(f"/v1/sessions/{sid}").json()["history"]
    prompt = tok(
        tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    generated = history[len(prompt) :]
    assert history[: len(prompt)] == prompt
    # the case under test: the reply's text does not tokenize back to what was generated
    assert tok(reply, add_special_tokens=False)["input_ids"] != generated, reply
    second = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Why those three fruits, and not others?"},
    ]
    r2 = http.post("/v1/chat/completions", json={"messages": second, "max_tokens": 4})
    assert r2.status_code == 200, r2.text
    body = r2.json()
    assert body["session_id"] == sid  # reused
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history)
    after = http.get(f"/v1/sessions/{sid}").json()["history"]
    assert after[: len(history)] == history  # the generated ids kept
    rest = tok.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    rest = rest[len(tok.decode(history, skip_special_tokens=False)) :]
    prompt2 = history + tok(rest, add_special_tokens=False)["input_ids"]
    assert after[: len(prompt2)] == prompt2
    # the reply was decoded past the cache's sink + window, and it is greedy decoding of
    # exactly those ids (the in-process oracle over the same cache configuration)
    assert len(prompt2) > SINK + WINDOW
    from kakeya_lab.backends.config import SinkWindowConfig
    from kakeya_lab.session import SessionStore, Token

    store = SessionStore(default_model.model, SinkWindowConfig(sink=SINK, window=WINDOW))
    oracle = store.create()
    store.append(oracle, prompt2)
    assert after[len(prompt2) :] == [
        e.id for e in store.generate(oracle, 4) if isinstance(e, Token)
    ]
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
