"""A base model served: a real ``kakeya-lab serve`` of a tiny random model whose tokenizer
has no chat template and whose config declares no end-of-sequence token.

* token-id sessions work without a chat template (create, append ids, generate), and
  only the chat-text operations are refused, naming the missing template;
* the stop set: with no end-of-sequence id, a generation with no stop ids is refused
  (INVALID_ARGUMENT / 400) unless it sets ``allow_no_stop``; stop ids make it valid.
  (A model with an end-of-sequence id has a non-empty default stop set: every other
  served test generates without ``stop_token_ids``.)
"""

from __future__ import annotations

import pytest

grpc = pytest.importorskip("grpc", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")

from conftest import Server  # noqa: E402

from kakeya_lab.models import tiny_random_model  # noqa: E402
from kakeya_lab.session.store import model_eos_ids  # noqa: E402

pytestmark = pytest.mark.slow

IDS = [101, 202, 303, 404, 505, 606]


@pytest.fixture(scope="module")
def base_server(serve, tmp_path_factory) -> Server:
    """The tiny random model saved as a base model: no chat template, no end-of-sequence id."""
    folder = tmp_path_factory.mktemp("tiny-base")
    tiny = tiny_random_model("qwen3", seed=0)
    tiny.model.config.eos_token_id = None
    tiny.model.generation_config.eos_token_id = None
    assert not model_eos_ids(tiny.model)
    tiny.model.save_pretrained(folder, safe_serialization=True)
    tiny.tokenizer.chat_template = None
    tiny.tokenizer.save_pretrained(folder)
    return serve("--sink", "4", "--window", "28", model=str(folder))


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_token_id_sessions_need_no_chat_template(base_server):
    with base_server.client() as client:
        sid = client.create()
        appended = client.append_ids(sid, IDS)
        assert appended.appended_tokens == len(IDS)
        reply = client.generate(sid, 40, stop_token_ids=[7])
        assert reply.done is not None and 0 < len(reply.token_ids) <= 40
        info = client.info(sid, include_history=True)
        assert list(info.history) == IDS + reply.token_ids
        assert info.history_len > 4 + 28  # past the window: the session evicts as any other
        # only the text operations are refused, naming the missing template; nothing changed
        for role in ("user", "assistant"):
            error = _refused(lambda role=role: client.append_text(sid, "Hello", role=role))
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "chat template" in error.details() and "token ids" in error.details()
        assert client.info(sid).history_len == info.history_len
        error = _refused(lambda: client.create(system_prompt="You are brief."))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "chat template" in error.details()
        client.close_session(sid)
    r = httpx.post(
        f"{base_server.http_base}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": ["."]},
        timeout=60,
    )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    assert base_server.metrics()["kakeya_sessions_open"] == 0


def test_an_empty_stop_set_is_refused_unless_allowed(base_server):
    with base_server.client() as client:
        sid = client.create()
        client.append_ids(sid, IDS)
        error = _refused(lambda: client.generate(sid, 5))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "stop set is empty" in error.details() and "allow_no_stop" in error.details()
        assert client.info(sid).history_len == len(IDS)  # refused before anything ran
        allowed = client.generate(sid, 5, allow_no_stop=True)
        assert len(allowed.token_ids) == 5 and allowed.done.stop_reason == "max_tokens"
        client.close_session(sid)
    with httpx.Client(base_url=base_server.http_base, timeout=60) as http:
        sid = http.post("/v1/sessions").json()["session_id"]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = http.post("/v1/chat/completions", json={**body, "session_id": sid})
        # the template is missing first; the stop set is checked before it, with the options
        assert r.status_code == 400 and "stop set is empty" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={**body, "allow_no_stop": True})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        http.delete(f"/v1/sessions/{sid}")
