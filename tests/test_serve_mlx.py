"""``kakeya-lab serve --backend mlx``: the same gRPC and OpenAI-compatible front ends over a
session store on the MLX backend (CPU on Linux). Greedy replies through the gRPC client and
the ``openai`` client equal the in-process MLX session's over the same cache configuration
(a window small enough to evict), plain and with a draft tree."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core", reason="needs the mlx extra")
pytest.importorskip("grpc", reason="needs the serve extra")
pytest.importorskip("openai", reason="needs the serve extra")

from kakeya_lab.backends.config import SinkWindowConfig  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL, load_model  # noqa: E402
from kakeya_lab.session import SessionStore, Token  # noqa: E402

pytestmark = pytest.mark.slow

SINK, WINDOW = 4, 28


def test_mlx_server_greedy_equals_the_in_process_mlx_session(serve):
    server = serve("--backend", "mlx", "--sink", str(SINK), "--window", str(WINDOW))
    loaded = load_model(DEFAULT_MODEL, backend="mlx", progress=False)
    tok = loaded.tokenizer
    store = SessionStore(loaded.model, SinkWindowConfig(sink=SINK, window=WINDOW))

    def in_process(turns: list[list[int]], n: int) -> list[list[int]]:
        sid = store.create()
        out = []
        for ids in turns:
            store.append(sid, ids)
            out.append([e.id for e in store.generate(sid, n) if isinstance(e, Token)])
        store.close(sid)
        return out

    turns = [
        tok(text, add_special_tokens=False)["input_ids"]
        for text in (
            "The old lighthouse keeper climbed the spiral stairs every evening, and",
            " Then the fog rolled in from the sea, so",
        )
    ]
    with server.client() as client:
        for proposer in ("none", "suffix-tree"):  # a draft tree verified on the MLX server
            sid = client.create()
            served = []
            for ids in turns:
                client.append_ids(sid, ids)
                served.append(client.generate(sid, 12, proposer=proposer).token_ids)
            info = client.info(sid)
            client.close_session(sid)
            assert info.history_len > SINK + WINDOW == info.cache_len  # the window evicted
            assert served == in_process(turns, 12), proposer

    messages = [{"role": "user", "content": "Name three colours."}]
    reply = server.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        extra_body={"reuse": False},
    )
    prompt = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    expected = in_process([prompt], 10)[0]
    eos = set(store.eos_token_ids)
    text = tok.decode([t for t in expected if t not in eos], skip_special_tokens=True)
    assert reply.choices[0].message.content == text
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected)
