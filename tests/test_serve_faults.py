"""Faults against a real ``kakeya-lab serve`` (default model, loopback): real engine errors,
a non-streaming HTTP client that hangs up, and after each fault the server back to its
baseline.

Engine errors are provoked for real, not simulated: a user's proposer whose code raises
(``tests/proposer_that_fails.py``, loaded into the server with ``--proposer-module``: a
``RuntimeError`` inside the engine -> ``INTERNAL`` / 500), and a proposer spec that cannot
be built (``ngram:0`` -> ``INVALID_ARGUMENT`` / 400). (A temperature of 1e-45, which once
overflowed the sampler into NaN, is now refused up front.) A draft model with
another vocabulary cannot be provoked here: a server loads its draft models at startup
(``--draft``), where one with another tokenizer is refused, and refuses every ``draft:``
spec it did not load before the engine runs.

Baseline (``Server.assert_back_to`` in conftest): open sessions and live KV bytes
(``/metrics``) must return exactly to their values before the fault, the live heap and the
resident size to within tolerances (the allocator keeps freed memory for reuse, so the
resident size does not shrink back byte for byte).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="needs the serve extra")
openai = pytest.importorskip("openai", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")

from kakeya_lab.backends.config import SinkWindowConfig  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL  # noqa: E402
from kakeya_lab.session import SessionStore, Token  # noqa: E402

pytestmark = pytest.mark.slow

SINK, WINDOW = 4, 60
CONFIG = SinkWindowConfig(sink=SINK, window=WINDOW)
FAILING = Path(__file__).with_name("proposer_that_fails.py")
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "out loud as his father had taught him. At the top he"
)


@pytest.fixture(scope="module")
def server(serve, default_model):
    """The server, warmed once over gRPC and HTTP so that its heap has its working set
    before any test takes a baseline (whichever test runs first, or alone)."""
    server = serve(
        "--sink", str(SINK), "--window", str(WINDOW), "--capacity", "6",
        "--proposer-module", str(FAILING),
    )  # fmt: skip
    story = default_model.tokenizer(STORY, add_special_tokens=False)["input_ids"]
    with server.client() as client:
        sid = client.create()
        client.append_ids(sid, story)
        client.generate(sid, 4)
        client.close_session(sid)
    with httpx.Client(base_url=server.http_base, timeout=300) as http:
        sid = http.post("/v1/sessions").json()["session_id"]
        body = {
            "messages": [{"role": "user", "content": STORY}],
            "max_tokens": 4,
            "session_id": sid,
        }
        assert http.post("/v1/chat/completions", json=body).is_success
        assert http.delete(f"/v1/sessions/{sid}").is_success
    return server


@pytest.fixture(scope="module")
def greedy(default_model):
    """In-process greedy continuation of a prompt over the same cache configuration."""
    store = SessionStore(default_model.model, CONFIG, capacity=4)

    def run(prompt: list[int], n: int) -> list[int]:
        sid = store.create()
        try:
            store.append(sid, prompt)
            return [e.id for e in store.generate(sid, n) if isinstance(e, Token)]
        finally:
            store.close(sid)

    return run


def test_engine_errors_map_to_clear_statuses_and_leave_sessions_untouched(
    server, default_model, greedy
):
    tok = default_model.tokenizer
    story = tok(STORY, add_special_tokens=False)["input_ids"]
    other_prompt = tok("Count: one, two, three, four,", add_special_tokens=False)["input_ids"]
    before = server.footprint()

    # a clean session generating concurrently with every fault below
    other: dict = {}

    def clean_run() -> None:
        with server.client() as c:
            s = c.create()
            c.append_ids(s, other_prompt)
            other["ids"] = c.generate(s, 24).token_ids
            c.close_session(s)

    runner = threading.Thread(target=clean_run)
    runner.start()
    with server.client() as client:
        sid = client.create()
        client.append_ids(sid, story)
        before_info = client.info(sid, include_history=True)
        for _ in range(2):  # twice: the engine error does not wedge the session
            with pytest.raises(grpc.RpcError) as info:
                client.generate(sid, 8, proposer="fails")
            assert info.value.code() is grpc.StatusCode.INTERNAL
            msg = info.value.details()
            assert "engine error in Generate (RuntimeError)" in msg and "on purpose" in msg, msg
        with pytest.raises(grpc.RpcError) as info:
            client.generate(sid, 8, proposer="ngram:0")
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "bad n-gram sizes in 'ngram:0'" in info.value.details()
        after_info = client.info(sid, include_history=True)
        assert list(after_info.history) == list(before_info.history)  # nothing committed
        assert after_info.cache_len == before_info.cache_len
        # the failed session still decodes exactly what a clean session would
        assert client.generate(sid, 8).token_ids == greedy(story, 8)
        client.close_session(sid)

    oc = server.openai()
    messages = [{"role": "user", "content": "Say hello."}]
    with pytest.raises(openai.InternalServerError) as http_info:
        oc.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"reuse": False, "proposer": "fails"},
        )
    body = http_info.value.body
    assert http_info.value.status_code == 500 and isinstance(body, dict)
    assert body["type"] == "engine_error" and "on purpose" in body["message"], body
    with pytest.raises(openai.BadRequestError) as bad:
        oc.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"reuse": False, "proposer": "ngram:0"},
        )
    assert "bad n-gram sizes in 'ngram:0'" in str(bad.value)

    runner.join(timeout=300)
    assert other["ids"] == greedy(other_prompt, 24)  # the concurrent session: as a clean run
    server.assert_back_to(before)


def test_non_streaming_http_client_that_hangs_up_stops_generation(server, default_model, greedy):
    """A plain (non-streaming) chat completion whose client disconnects: generation stops
    within a poll interval and a token, and the session keeps the tokens committed so far,
    which are the greedy continuation's first ones."""
    tok = default_model.tokenizer
    http = httpx.Client(base_url=server.http_base, timeout=60)
    before = server.footprint()
    cancelled_before = server.cancelled_streams()
    sid = http.post("/v1/sessions").json()["session_id"]
    messages = [{"role": "user", "content": "Tell me a very long story about the sea."}]
    prompt = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    body = {"messages": messages, "max_tokens": 600, "session_id": sid}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        with httpx.Client(base_url=server.http_base, timeout=httpx.Timeout(60, read=3)) as c:
            c.post("/v1/chat/completions", json=body)
    server.wait_cancelled(cancelled_before)  # one token's time on a busy machine, with room
    stopped_after = time.monotonic() - t0
    info = http.get(f"/v1/sessions/{sid}").json()
    time.sleep(1.0)
    again = http.get(f"/v1/sessions/{sid}").json()
    assert again["history_len"] == info["history_len"]  # generation has stopped
    generated = again["history"][len(prompt) :]
    assert again["history"][: len(prompt)] == prompt
    assert 0 < len(generated) < 600, (len(generated), stopped_after)
    assert generated == greedy(prompt, len(generated))
    # the session is free again and continues from exactly those tokens
    more = {
        "messages": messages,
        "max_tokens": 2,
        "session_id": sid,
    }
    r = http.post("/v1/chat/completions", json=more)
    assert r.status_code == 400 and "do not extend" in r.json()["error"]["message"]
    assert http.get(f"/v1/sessions/{sid}").json()["history_len"] == again["history_len"]
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    http.close()
    server.assert_back_to(before)
