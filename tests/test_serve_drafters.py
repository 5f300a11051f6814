"""Named drafters on the served session path: a drafter trained by the real ``kakeya-lab
align train`` for the default model (a few steps: mechanics, not quality), loaded once by
``kakeya-lab serve --draft drafter:NAME`` and named per request as ``drafter:NAME`` (chains)
or ``drafter-tree:NAME`` (EAGLE-2 trees), and a LoRA drafter, which drafts as a draft model
(its adapters merged once) with a draft cache per session.

Each session's proposer reads the hidden states its own verifier records; greedy replies
equal in-process plain greedy decoding of the same token ids over several turns, past
eviction, while the session switches between chains, trees, plain decoding and back.
``KAKEYA_LAB_DRAFTERS`` points at a temporary folder (for the training run and the server
it starts) so the user's named drafters are never touched.
"""

from __future__ import annotations

import pytest

grpc = pytest.importorskip("grpc", reason="needs the serve extra")
httpx = pytest.importorskip("httpx", reason="needs the serve extra")

from conftest import Server, drafters_home, grpc_turns_equal_plain, plain_greedy  # noqa: E402

from kakeya_lab.backends.config import SinkWindowConfig  # noqa: E402
from kakeya_lab.cli import main  # noqa: E402
from kakeya_lab.session import SessionStore  # noqa: E402

pytestmark = pytest.mark.slow

SINK, WINDOW = 4, 60
CONFIG = SinkWindowConfig(sink=SINK, window=WINDOW)
NAME, LORA_NAME = "served-feature", "served-lora"
DATA = [
    "--conversations", "2", "--dev-conversations", "1", "--turns", "1", "--max-new-tokens", "24",
    "--window", "60", "--teacher-conversations", "2", "--teacher-turns", "3", "--quiet",
]  # fmt: skip
TRAIN = [
    ["align", "train", NAME, "--kind", "feature", "--steps", "8", "--draft-vocab", "512", *DATA],
    ["align", "train", LORA_NAME, "--kind", "lora", "--steps", "2", "--batch-size", "4", *DATA],
]
CHAIN, TREE, LORA = f"drafter:{NAME}", f"drafter-tree:{NAME}", f"drafter:{LORA_NAME}"
QUESTIONS = [
    "Tell me about the sea in two sentences.",
    "And about mountains?",
    "Which is older?",
    "Name a river.",
    "And a lake?",
]
PROPOSERS = [CHAIN, TREE, "none", LORA, CHAIN]
MAX_NEW = 24


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory) -> Server:
    """A server that loaded two freshly trained named drafters, a feature drafter and a
    LoRA one (``KAKEYA_LAB_DRAFTERS`` set for the training runs and the server process
    only). The two share a work folder: the second reuses the first's capture."""
    root = tmp_path_factory.mktemp("served-drafters")
    with drafters_home(root / "drafters"):
        for command in TRAIN:
            assert main([*command, "--work-dir", str(root / "work")]) == 0
        return serve(
            "--sink", str(SINK), "--window", str(WINDOW), "--draft", CHAIN, "--draft", LORA
        )  # fmt: skip


@pytest.fixture(scope="module")
def store(default_model):
    """In-process sessions over the same model and cache configuration (the oracle)."""
    return SessionStore(default_model.model, CONFIG, capacity=4)


def _plain(store: SessionStore, sid: str, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    return plain_greedy(store, sid, ids, max_new)


def test_grpc_drafter_chains_and_trees_equal_in_process_plain_greedy(server, store, default_model):
    with server.client() as client:
        turns = list(zip(QUESTIONS, PROPOSERS))
        sid, info, steps = grpc_turns_equal_plain(
            client, store, default_model.tokenizer, turns, MAX_NEW
        )
        for (_, proposer), st in zip(turns, steps):
            assert bool(st) == (proposer != "none"), proposer  # speculative decoding ran
        assert info.history_len > SINK + WINDOW  # the verifier's window evicted
        assert sum(s.proposed for st in steps for s in st) > 0  # the drafters drafted
        assert info.draft_kv_live_bytes > 0  # the LoRA drafter's own draft cache
        client.close_session(sid)


def test_http_streamed_drafter_turn_equals_in_process_plain_greedy(server, store, default_model):
    tok = default_model.tokenizer
    oracle = store.create()
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    body = {"messages": messages, "max_tokens": MAX_NEW, "proposer": CHAIN, "draft_length": 3}
    with httpx.Client(base_url=server.http_base, timeout=300) as http:
        sid = http.post("/v1/sessions").json()["session_id"]
        r = http.post("/v1/chat/completions", json={**body, "session_id": sid})
        assert r.status_code == 200, r.text
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok(rendered, add_special_tokens=False)["input_ids"]
        reply = _plain(store, oracle, prompt)
        info = http.get(f"/v1/sessions/{sid}").json()
        assert info["history"] == prompt + reply
        assert info["proposed"] > 0
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    store.close(oracle)


def test_loaded_drafter_is_listed_and_others_are_refused_with_the_flag(server):
    listed = httpx.get(f"{server.http_base}/v1/proposers", timeout=60).json()["data"]
    loaded = {row["id"]: row["tree"] for row in listed if row["loaded"]}
    assert loaded == {CHAIN: False, TREE: True, LORA: False}  # a LoRA drafter drafts chains
    with server.client() as client:
        sid = client.create()
        client.append_text(sid, "Hi!")
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(sid, 4, proposer="drafter:other")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details()
        assert "--draft drafter:other" in details and CHAIN in details, details
        with pytest.raises(grpc.RpcError) as refused:  # loaded, but it drafts no trees
            client.generate(sid, 4, proposer=f"drafter-tree:{LORA_NAME}")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "only a feature drafter drafts trees" in refused.value.details()
        assert client.info(sid).generated_tokens == 0  # refused before anything ran
        client.close_session(sid)
