"""The recall probe: a fact planted in the first user turn, asked for every ``every``
turns on a provisional block that is rolled back (the session never sees the question),
through the store's own API (:meth:`SessionStore.probe`) and a fork of the chat template.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kakeya_lab.chat import ChatTemplate

if TYPE_CHECKING:  # a resume's check reads the probe's settings before torch is imported
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


def probe_recall(
    store: SessionStore,
    session_id: str,
    chat: ChatTemplate,
    probe: FactProbe,
    eos_ids: Collection[int],
    max_new_tokens: int = 12,
) -> str:
    """Ask ``probe.question`` without changing the session or ``chat``; the answer text."""
    ids = chat.fork().user(probe.question)
    answer = store.probe(session_id, ids, max_new_tokens, stop_token_ids=list(eos_ids))
    return chat.tokenizer.decode(answer, skip_special_tokens=True)
