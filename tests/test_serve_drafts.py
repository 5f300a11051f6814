"""Draft models on the served session path: a real ``kakeya-lab serve --draft
draft:smollm2-135m-instruct:int4`` (the default model verifying, a small window so every
conversation here evicts), driven over gRPC and HTTP streaming.

Greedy replies with the draft proposer equal in-process plain greedy decoding of the same
token ids (the store's own sessions, the oracle) over several turns, past eviction, while
the session switches proposer between turns (the session's draft cache catches up with the
turns it did not draft). The draft cache is the session's own: reported by its info and
the server's memory metric, freed with the session. A proposer the server has not loaded
is refused with what is loaded and the flag that loads it; ``GET /v1/proposers`` lists it.
"""

from __future__ import annotations

import json

import pytest

grpc = pytest.importorskip("grpc", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")

from conftest import Server, grpc_turns_equal_plain, plain_greedy  # noqa: E402

from kakeya_lab.backends.config import SinkWindowConfig  # noqa: E402
from kakeya_lab.session import SessionStore  # noqa: E402

pytestmark = pytest.mark.slow

SINK, WINDOW = 4, 60
CONFIG = SinkWindowConfig(sink=SINK, window=WINDOW)
DRAFT = "draft:smollm2-135m-instruct:int4"
QUESTIONS = [
    "Tell me about the sea in two sentences.",
    "And about mountains?",
    "Which is older?",
    "Name a river.",
]
# the proposer of each turn: the draft cache follows the session across turns it skips
PROPOSERS = [DRAFT, "ngram", DRAFT, DRAFT]
MAX_NEW = 24


@pytest.fixture(scope="module")
def server(serve) -> Server:
    return serve("--sink", str(SINK), "--window", str(WINDOW), "--capacity", "4", "--draft", DRAFT)


@pytest.fixture(scope="module")
def store(default_model):
    """In-process sessions over the same model and cache configuration (the oracle)."""
    return SessionStore(default_model.model, CONFIG, capacity=4)


def _plain(store: SessionStore, sid: str, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    return plain_greedy(store, sid, ids, max_new)


def test_grpc_draft_turns_equal_in_process_plain_greedy(server, store, default_model):
    with server.client() as client:
        turns = list(zip(QUESTIONS, PROPOSERS))
        sid, info, steps = grpc_turns_equal_plain(
            client, store, default_model.tokenizer, turns, MAX_NEW
        )
        assert all(steps)  # speculative decoding ran on every turn
        accepted = sum(s.accepted for (_, p), st in zip(turns, steps) if p == DRAFT for s in st)
        assert info.history_len > SINK + WINDOW  # the verifier's window evicted
        assert accepted > 0  # the draft model drafted, and some drafts were kept
        assert info.draft_kv_live_bytes > 0  # the session's own draft cache
        metrics = server.metrics()
        assert metrics["kakeya_kv_live_bytes"] >= info.kv_live_bytes + info.draft_kv_live_bytes
        client.close_session(sid)
        assert server.metrics()["kakeya_kv_live_bytes"] == 0  # the draft cache went with it


def test_a_cancelled_draft_turn_leaves_the_draft_cache_consistent(server, store, default_model):
    """A draft stream cancelled after a few tokens (its draft cache drafted past what the
    session kept): the following turns, drafting and not, still equal plain greedy decoding
    of the session's history (token-id appends, past eviction)."""
    tok = default_model.tokenizer
    texts = [
        "The old lighthouse keeper climbed the spiral stairs every evening and",
        " Then the fog came in from the sea, and",
        " At dawn the villagers",
        " Years later,",
    ]
    oracle = store.create()
    with server.client() as client:
        sid = client.create()
        for i, text in enumerate(texts):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            client.append_ids(sid, ids)
            before = client.info(sid).history_len
            if i == 0:
                cancelled = server.cancelled_streams()
                call = client.stream(sid, MAX_NEW, proposer=DRAFT)
                received = []
                for event in call:
                    if event.WhichOneof("event") == "token":
                        received.append(event.token.id)
                        if len(received) == 3:
                            call.cancel()
                            break
                # the session settles when the server notices the cancel: only then is
                # its history final (a token sent meanwhile, in flight, is kept)
                server.wait_cancelled(cancelled)
                kept = client.info(sid).history_len - before
                assert 3 <= kept < MAX_NEW
                expected = _plain(store, oracle, ids, max_new=kept)
                assert expected[:3] == received
            else:
                proposer = "none" if i == 2 else DRAFT
                got = client.generate(sid, MAX_NEW, proposer=proposer).token_ids
                expected = _plain(store, oracle, ids)
                assert got == expected, (i, proposer)
        history = list(client.info(sid, include_history=True).history)
        assert history == store.verifier(oracle).history_token_ids
        assert len(history) > SINK + WINDOW
        client.close_session(sid)
    store.close(oracle)


def _stream(http: httpx.Client, body: dict) -> str:
    text = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return "".join(text)


def test_http_streamed_draft_turns_equal_in_process_plain_greedy(server, store, default_model):
    """An explicit HTTP session over several streamed turns (the conversation re-sent each
    turn, only its new tokens prefilled), drafting with the loaded draft model on all but
    one turn: its history equals in-process plain greedy decoding of the same prompts."""
    tok = default_model.tokenizer
    oracle = store.create()
    with httpx.Client(base_url=server.http_base, timeout=300) as http:
        sid = http.post("/v1/sessions").json()["session_id"]
        messages: list[dict] = []
        for question, proposer in zip(QUESTIONS, PROPOSERS[::-1]):
            messages.append({"role": "user", "content": question})
            text = _stream(
                http,
                {
                    "messages": messages,
                    "max_tokens": MAX_NEW,
                    "session_id": sid,
                    "proposer": proposer,
                    "draft_length": 3,
                },
            )
            rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt = tok(rendered, add_special_tokens=False)["input_ids"]
            history = store.verifier(oracle).history_token_ids
            assert prompt[: len(history)] == history  # what the server checks too
            reply = _plain(store, oracle, prompt[len(history) :])
            shown = [t for t in reply if t != tok.eos_token_id]
            assert text == tok.decode(shown), (question, proposer)
            messages.append({"role": "assistant", "content": text})
        info = http.get(f"/v1/sessions/{sid}").json()
        assert info["history"] == store.verifier(oracle).history_token_ids
        assert info["history_len"] > SINK + WINDOW and info["accepted"] > 0
        assert info["draft_kv_live_bytes"] > 0
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    store.close(oracle)


def test_a_proposer_not_loaded_is_refused_and_loaded_ones_are_listed(server):
    listed = httpx.get(f"{server.http_base}/v1/proposers", timeout=60).json()["data"]
    loaded = [row["id"] for row in listed if row["loaded"]]
    assert loaded == [DRAFT] and "ngram" in [row["id"] for row in listed]
    other = "draft:smollm2-135m-instruct:int8"  # the same model, a kernel not loaded
    with server.client() as client:
        sid = client.create()
        client.append_text(sid, "Hi!")
        for spec in (other, "early-exit:8"):
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(sid, 4, proposer=spec)
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            details = refused.value.details()
            assert DRAFT in details and "--draft" in details, details
        assert client.info(sid).generated_tokens == 0  # refused before anything ran
        client.close_session(sid)
    r = httpx.post(
        f"{server.http_base}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "proposer": other},
        timeout=60,
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == 400
    assert f"--draft {other}" in error["message"] and DRAFT in error["message"]
