"""Safe exposure and session ownership, against real ``kakeya-lab serve`` subprocesses driven
by the ``openai`` client, httpx and grpcio (the project's client):

* ``keyed``: two API keys in a key file, one extra Host name and one allowed Origin;
* ``open``: no key (loopback only), one anonymous owner.

Checked: 401 / ``UNAUTHENTICATED`` without a valid key on every route but ``/health`` and on
every gRPC call; Host and Origin checks (DNS rebinding, web pages); an explicit session is
never taken over by prefix reuse; reuse, ``cached_tokens`` and session ids never cross keys,
and another key's session is unknown (404 / ``NOT_FOUND``) for every operation.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

grpc = pytest.importorskip("grpc", reason="needs the serve extra")
openai = pytest.importorskip("openai", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")

from conftest import Server  # noqa: E402

from kakeya_lab.models import DEFAULT_MODEL  # noqa: E402
from kakeya_lab.serve.client import SessionClient  # noqa: E402

pytestmark = pytest.mark.slow

KEY1, KEY2 = "first-key-0123456789", "second-key-9876543210"
ALLOWED_HOST, ALLOWED_ORIGIN = "kakeya.test", "http://ok.example"


@pytest.fixture(scope="module")
def servers(serve, tmp_path_factory) -> dict[str, Server]:
    common = ("--sink", "4", "--window", "60", "--capacity", "6")
    keyed_args = (*common, "--allowed-host", ALLOWED_HOST, "--allowed-origin", ALLOWED_ORIGIN)
    with ThreadPoolExecutor(2) as pool:
        keyed = pool.submit(
            serve, *keyed_args, api_keys=(KEY1, KEY2), key_dir=tmp_path_factory.mktemp("keys")
        )
        open_ = pool.submit(serve, *common)
        return {"keyed": keyed.result(), "open": open_.result()}


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch):
    """The clients would send ``$KAKEYA_LAB_API_KEY``; these tests choose each key."""
    monkeypatch.delenv("KAKEYA_LAB_API_KEY", raising=False)


def _port(server: Server) -> str:
    return server.http_base.rsplit(":", 1)[1]


def _chat(oc, messages, **extra):
    return oc.chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=3, extra_body=extra or None
    )


# ---------------------------------------------------------------- authentication


def test_every_route_but_health_needs_a_key(servers):
    server = servers["keyed"]
    http = httpx.Client(base_url=server.http_base, timeout=60)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    calls = [
        ("GET", "/v1/models", None),
        ("GET", "/v1/proposers", None),
        ("GET", "/metrics", None),
        ("POST", "/v1/sessions", None),
        ("GET", "/v1/sessions/0123456789abcdef", None),
        ("DELETE", "/v1/sessions/0123456789abcdef", None),
        ("POST", "/v1/chat/completions", body),
    ]
    open_before = server.metrics()["kakeya_sessions_open"]
    for headers in ({}, {"Authorization": "Bearer wrong-key-000000"}, {"Authorization": KEY1}):
        for method, path, json in calls:
            r = http.request(method, path, json=json, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.text)
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert server.metrics()["kakeya_sessions_open"] == open_before  # nothing was created
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/v1/models", headers=server.headers(KEY2)).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.openai(api_key="wrong-key-000000").models.list()
    assert [m.id for m in server.openai(api_key=KEY2).models.list().data] == [DEFAULT_MODEL]
    http.close()


def test_every_grpc_call_needs_a_key(servers):
    server = servers["keyed"]
    with server.client(api_key=KEY1) as owner:
        sid = owner.create()
        for key in (None, "wrong-key-000000"):
            with SessionClient(server.grpc_target, timeout_s=60, api_key=key) as stranger:
                calls = [
                    stranger.create,
                    lambda: stranger.info(sid),
                    lambda: stranger.append_text(sid, "hi"),
                    lambda: stranger.generate(sid, 2),
                    lambda: stranger.close_session(sid),
                ]
                for call in calls:
                    with pytest.raises(grpc.RpcError) as refused:
                        call()
                    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert owner.info(sid).history_len == 0  # untouched
        owner.close_session(sid)


# ------------------------------------------------------------------ Host, Origin


@pytest.mark.parametrize("which", ["keyed", "open"])
def test_host_and_origin_are_checked(servers, which):
    server = servers[which]
    http = httpx.Client(base_url=server.http_base, timeout=60, headers=server.headers())
    port = _port(server)
    open_before = server.metrics()["kakeya_sessions_open"]
    # a page on another site reaching a loopback server through DNS rebinding
    for host in (f"evil.example:{port}", "evil.example", f"{ALLOWED_HOST}.evil:{port}"):
        for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("POST", "/v1/sessions")):
            r = http.request(method, path, headers={"Host": host})
            assert r.status_code == 400, (host, path, r.text)
            assert r.json()["error"]["code"] == "invalid_host"
    # a page of another origin calling the server from a browser
    r = http.post("/v1/sessions", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert server.metrics()["kakeya_sessions_open"] == open_before
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200
    if which == "keyed":
        assert http.get("/v1/models", headers={"Host": f"{ALLOWED_HOST}:{port}"}).status_code == 200
        sid = http.post("/v1/sessions", headers={"Origin": ALLOWED_ORIGIN}).json()["session_id"]
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    else:
        assert http.get("/v1/models", headers={"Host": ALLOWED_HOST}).status_code == 400
    http.close()


# -------------------------------------------------------------------- ownership


def test_an_explicit_session_is_never_taken_over(servers):
    """``open`` server: a client's empty ``POST /v1/sessions`` session is not matched by a
    stranger's stateless request (an empty history is a prefix of every prompt): the
    stranger gets a fresh session and no cached tokens, and the owner's next turn works
    (before, the stranger took it over, received its id, and the owner got 400)."""
    server = servers["open"]
    http = httpx.Client(base_url=server.http_base, timeout=60)
    oc = server.openai()
    sid = http.post("/v1/sessions").json()["session_id"]
    stranger = _chat(oc, [{"role": "user", "content": "What is my secret?"}])
    assert stranger.model_extra["session_id"] != sid
    assert stranger.usage.prompt_tokens_details.cached_tokens == 0
    mine = [{"role": "user", "content": "My secret is 42."}]
    reply = _chat(oc, mine, session_id=sid)
    assert reply.model_extra["session_id"] == sid
    info = http.get(f"/v1/sessions/{sid}").json()
    assert info["history_len"] == reply.usage.total_tokens  # only the owner's turn
    # named by its client, the session is not matched by prefix either
    follow = [*mine, {"role": "assistant", "content": reply.choices[0].message.content or ""}]
    again = _chat(oc, [*follow, {"role": "user", "content": "And?"}])
    assert again.model_extra["session_id"] != sid
    for s in (sid, stranger.model_extra["session_id"], again.model_extra["session_id"]):
        assert http.delete(f"/v1/sessions/{s}").status_code == 200
    http.close()


def test_reuse_and_session_ids_never_cross_keys(servers):
    """``keyed`` server: the first key's implicit session is reused by the first key only;
    the second key sending the same conversation (a right guess) gets a fresh session and
    0 cached tokens, exactly as for a wrong guess, and the first key's session ids are
    unknown to it for every HTTP and gRPC operation (404 / NOT_FOUND, the message of an id
    that never existed)."""
    server = servers["keyed"]
    one, two = server.openai(api_key=KEY1), server.openai(api_key=KEY2)
    conversation = [{"role": "user", "content": "My password is swordfish."}]
    first = _chat(one, conversation)
    s1 = first.model_extra["session_id"]
    turn = [
        *conversation,
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Repeat it."},
    ]
    # the second key's right and wrong guesses look the same
    right = _chat(two, turn)
    wrong = _chat(two, [{"role": "user", "content": "My password is hunter2."}])
    for guess in (right, wrong):
        assert guess.usage.prompt_tokens_details.cached_tokens == 0
        assert guess.model_extra["session_id"] != s1
    # the first key's own continuation reuses its session
    mine = _chat(one, turn)
    assert mine.model_extra["session_id"] == s1
    assert mine.usage.prompt_tokens_details.cached_tokens == first.usage.total_tokens

    http2 = httpx.Client(base_url=server.http_base, timeout=60, headers=server.headers(KEY2))
    unknown = "0123456789abcdef"
    for sid in (s1, unknown):
        for r in (http2.get(f"/v1/sessions/{sid}"), http2.delete(f"/v1/sessions/{sid}")):
            assert r.status_code == 404
            assert r.json()["error"]["message"] == f"unknown session id {sid!r}"
    with pytest.raises(openai.NotFoundError):
        _chat(two, turn, session_id=s1)
    with SessionClient(server.grpc_target, timeout_s=60, api_key=KEY2) as stranger:
        for call in (
            lambda: stranger.info(s1),
            lambda: stranger.append_ids(s1, [1, 2]),
            lambda: stranger.generate(s1, 2),
            lambda: stranger.close_session(s1),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() is grpc.StatusCode.NOT_FOUND
            assert refused.value.details() == f"unknown session id {s1!r}"
    # the first key's session is intact and its own
    http1 = httpx.Client(base_url=server.http_base, timeout=60, headers=server.headers(KEY1))
    info = http1.get(f"/v1/sessions/{s1}").json()
    assert info["history_len"] == mine.usage.total_tokens
    # a gRPC session of the first key is unknown to the second over HTTP too
    with server.client(api_key=KEY1) as owner:
        g1 = owner.create()
        assert http2.get(f"/v1/sessions/{g1}").status_code == 404
        owner.close_session(g1)
    for s in (s1, right.model_extra["session_id"], wrong.model_extra["session_id"]):
        client = http1 if s == s1 else http2
        assert client.delete(f"/v1/sessions/{s}").status_code == 200
    http1.close()
    http2.close()


def test_the_projects_clients_send_the_key_from_the_environment(servers, monkeypatch):
    """With ``$KAKEYA_LAB_API_KEY`` set, the project's gRPC client and the served long run
    (gRPC, ``openai`` and httpx) work against a keyed server and leave nothing open."""
    from kakeya_lab.bench.long_run.served import run_served_long_run

    server = servers["keyed"]
    open_before = server.metrics()["kakeya_sessions_open"]
    monkeypatch.setenv("KAKEYA_LAB_API_KEY", KEY2)
    with SessionClient(server.grpc_target, timeout_s=60) as client:
        client.close_session(client.create())
    table = run_served_long_run(
        server.grpc_target, server.http_base, ["Hi.", "Name a fruit."], max_new_tokens=2
    )
    assert len(table) == 6 and set(table["arm"]) == {"grpc_session", "http_reuse", "http_stateless"}
    assert server.metrics()["kakeya_sessions_open"] == open_before


def test_the_size_bound_of_a_refused_prompt_tells_nothing_of_other_keys(servers):
    """A prompt too long for any of the caller's sessions is refused with a bound made of
    the caller's own sessions only (before, the longest session of any key was added to it,
    so the refusal revealed another key's conversation length)."""
    server = servers["keyed"]
    one = server.openai(api_key=KEY1)
    first = _chat(one, [{"role": "user", "content": "Remember the number 7."}])
    s1 = first.model_extra["session_id"]
    huge = [{"role": "user", "content": "word " * 12000}]
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(server.openai(api_key=KEY2), huge)
    assert "the conversation has more than 8192 tokens" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as own:
        _chat(one, huge)
    assert f"more than {8192 + first.usage.total_tokens} tokens" in str(own.value)
    http1 = httpx.Client(base_url=server.http_base, timeout=60, headers=server.headers(KEY1))
    assert http1.delete(f"/v1/sessions/{s1}").status_code == 200
    http1.close()
