"""The recall probe: a fact planted in the first user turn, asked for every ``every``
turns on a provisional block that is rolled back (the session never sees the question).

Two seams stand in for APIs the session runtime provides: :func:`fork_chat` (to become
``chat.fork()``) and :func:`ask_provisionally` (to become ``store.probe(session_id,
token_ids, max_new_tokens, stop_token_ids=...)``). Each is one call site to switch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kakeya_lab.chat import ChatTemplate
from kakeya_lab.session import SessionStore


@dataclass(frozen=True)
class FactProbe:
    """A fact planted in the first user turn, asked for every ``every`` turns."""

    fact: str = "my locker code is 4812"
    question: str = "What is my locker code? Answer with the number only."
    answer: str = "4812"
    every: int = 25

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"probe every must be an integer >= 1, got {self.every!r}")


def fork_chat(chat: ChatTemplate) -> ChatTemplate:
    """A copy of ``chat`` that can take a turn without changing ``chat``.
    (Switch to ``chat.fork()`` once the runtime provides it.)"""
    scratch = ChatTemplate(chat.tokenizer)
    scratch.messages, scratch.rendered = list(chat.messages), chat.rendered
    scratch.awaiting_reply = chat.awaiting_reply
    return scratch


def ask_provisionally(
    store: SessionStore, session_id: str, token_ids: list[int], max_new_tokens: int,
    stop_token_ids: Collection[int],
) -> list[int]:
    """Greedy reply to ``token_ids`` on a provisional block of the session, rolled back:
    the session is unchanged afterwards. (Switch to ``store.probe(...)`` once the runtime
    provides it.)"""
    verifier = store.verifier(session_id)
    logits = verifier.forward_block(token_ids)[-1]
    answer: list[int] = []
    try:
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            if token in stop_token_ids:
                break
            answer.append(token)
            logits = verifier.forward_block([token])[-1]
    finally:
        verifier.rollback()
    return answer


def probe_recall(
    store: SessionStore, session_id: str, chat: ChatTemplate, probe: FactProbe,
    eos_ids: Collection[int], max_new_tokens: int = 12,
) -> str:
    """Ask ``probe.question`` without changing the session or ``chat``; the answer text."""
    ids = fork_chat(chat).user(probe.question)
    answer = ask_provisionally(store, session_id, ids, max_new_tokens, stop_token_ids=eos_ids)
    return chat.tokenizer.decode(answer, skip_special_tokens=True)
