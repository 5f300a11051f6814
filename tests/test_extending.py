"""The examples of docs/extending.md run as written: a proposer defined in a user's own file
outside the package, registered, then used through every entry point."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kakeya_lab import DEFAULT_MODEL, SinkWindowConfig
from kakeya_lab.proposers import (
    check_proposer_spec,
    make_proposer,
    proposer_kind,
    unregister_proposer,
    usage,
)
from kakeya_lab.session import SessionStore, collect_reply
from kakeya_lab.widgets.chat_panel import offered_proposer_specs

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"
CONFIG = SinkWindowConfig(sink=4, window=36)  # the conversation outgrows it: eviction


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def echo():
    """docs/examples/echo_proposer.py imported (which registers ``echo``), then removed."""
    module = _load(EXAMPLES / "echo_proposer.py")
    yield module
    unregister_proposer("echo")


def _two_turns(model, text_ids, proposer) -> tuple[list[list[int]], int]:
    """Two turns' replies, and how many drafted tokens the verifier accepted."""
    store = SessionStore(model, CONFIG)
    sid = store.create()
    replies, accepted = [], 0
    for turn in range(2):
        store.append(sid, text_ids[turn * 30 : (turn + 1) * 30])
        reply = collect_reply(store.generate(sid, 24, proposer=proposer))
        replies.append(reply.token_ids)
        accepted += sum(step.accepted for step in reply.steps)
    assert store.info(sid).history_len > CONFIG.budget  # the history outgrew the cache
    return replies, accepted


@pytest.mark.slow
def test_a_proposer_from_a_users_file_works_everywhere(echo, default_model, text_ids):
    assert proposer_kind("echo").model_free
    assert "echo[:WIDTH]" in usage()
    assert check_proposer_spec("echo:64") == [("echo", "64")]
    with pytest.raises(ValueError, match="bad width"):
        check_proposer_spec("echo:0")
    proposer = make_proposer("echo:64", default_model.model, CONFIG)
    assert isinstance(proposer, echo.EchoProposer) and proposer.width == 64

    plain, _ = _two_turns(default_model.model, text_ids, None)
    speculative, accepted = _two_turns(default_model.model, text_ids, proposer)
    assert speculative == plain  # lossless
    assert accepted > 0  # and the proposer's drafts were used

    assert "echo" in offered_proposer_specs(None, None, "torch")  # the chat panel's menu


@pytest.mark.slow
def test_a_server_lists_and_serves_a_users_proposer(serve):
    """``kakeya-lab serve --proposer-module FILE`` imports the user's file: the server lists
    ``echo`` among its proposers and a request naming it replies as plain decoding does."""
    import httpx

    server = serve("--proposer-module", str(EXAMPLES / "echo_proposer.py"), "--window", "60")
    listed = httpx.get(f"{server.http_base}/v1/proposers", timeout=60).json()["data"]
    assert "echo" in [p["id"] for p in listed]
    client = server.openai()
    messages = [{"role": "user", "content": "Count from one to twenty in words, then again."}]

    def reply(proposer: str) -> str:
        out = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=messages,
            max_tokens=48,
            temperature=0,
            extra_body={"proposer": proposer, "reuse": False},
        )
        return out.choices[0].message.content

    assert reply("echo:64") == reply("none")


@pytest.mark.slow
def test_the_usage_example_of_the_page_runs(monkeypatch):
    """docs/extending.md's usage block, run as written (with docs/examples on the path)."""
    import re
    import sys

    page = (EXAMPLES.parent / "extending.md").read_text()
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "import echo_proposer" in b
    ]
    assert len(blocks) == 1
    monkeypatch.syspath_prepend(str(EXAMPLES))
    namespace: dict = {}
    try:
        exec(compile(blocks[0], "docs/extending.md", "exec"), namespace)
    finally:
        sys.modules.pop("echo_proposer", None)
        unregister_proposer("echo")
    assert len(namespace["reply"].token_ids) > 0
