"""Incremental chat templating: token ids for the *new* part of a conversation only.

A session must append only each turn's new tokens. :class:`ChatTemplate` renders the whole
conversation with the tokenizer's own chat template, checks that what the session already
holds is a prefix of it, and returns the ids of the remainder. Concatenated over the turns,
these ids equal the tokenizer's template applied to the whole conversation (tested for the
default model).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence


class ChatTemplate:
    """Keeps the rendered text of a conversation and hands out per-turn token deltas."""

    def __init__(self, tokenizer, system: str | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("this tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.rendered = ""
        self.awaiting_reply = False

    def _render(self, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _delta(self, full: str) -> list[int]:
        if not full.startswith(self.rendered):
            raise ValueError(
                "the chat template re-renders earlier turns differently, so turns cannot be "
                "appended incrementally with this tokenizer"
            )
        delta = full[len(self.rendered) :]
        self.rendered = full
        return self.tokenizer(delta, add_special_tokens=False)["input_ids"]

    def user(self, text: str) -> list[int]:
        """Add a user turn; return its ids including the assistant generation prompt."""
        if self.awaiting_reply:
            raise ValueError("the previous user turn has no assistant reply yet")
        self.messages.append({"role": "user", "content": text})
        self.awaiting_reply = True
        return self._delta(self._render(add_generation_prompt=True))

    def assistant(self, text: str) -> list[int]:
        """Add a scripted assistant reply; return the ids to append for it (closing tags included)."""
        if not self.awaiting_reply:
            raise ValueError("an assistant reply needs a user turn before it")
        self.messages.append({"role": "assistant", "content": text})
        self.awaiting_reply = False
        return self._delta(self._render(add_generation_prompt=False))

    def generated(self, token_ids: Sequence[int], eos_token_ids: Collection[int] = ()) -> str:
        """Record a reply the model generated (already in the session); return its text.

        The session holds exactly ``token_ids``; the rendered text advances by their
        decoding, so the next turn's delta starts right after them.
        """
        if not self.awaiting_reply:
            raise ValueError("a generated reply needs a user turn before it")
        ids = list(token_ids)
        body = ids[:-1] if ids and ids[-1] in set(eos_token_ids) else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": text})
        self.awaiting_reply = False
        self.rendered += self.tokenizer.decode(ids, skip_special_tokens=False)
        return text

    def fork(self) -> ChatTemplate:
        """An independent copy (same tokenizer) to ask a side question without touching this one."""
        return ChatTemplate.from_state(self.tokenizer, self.to_state())

    def to_state(self) -> dict:
        """Plain JSON-able state for checkpoints (restore with :meth:`from_state`)."""
        return {
            "messages": copy.deepcopy(self.messages),
            "rendered": self.rendered,
            "awaiting_reply": self.awaiting_reply,
        }

    @classmethod
    def from_state(cls, tokenizer, state: dict) -> ChatTemplate:
        """A template continuing from :meth:`to_state`'s output, with ``tokenizer``."""
        missing = {"messages", "rendered", "awaiting_reply"} - set(state)
        if missing:
            raise ValueError(
                f"chat state lacks {sorted(missing)}: pass what ChatTemplate.to_state() returned"
            )
        chat = cls(tokenizer)
        chat.messages = copy.deepcopy(list(state["messages"]))
        chat.rendered = str(state["rendered"])
        chat.awaiting_reply = bool(state["awaiting_reply"])
        return chat

    def full_ids(self, add_generation_prompt: bool | None = None) -> list[int]:
        """The tokenizer's template over the whole conversation, as ids (the reference)."""
        if add_generation_prompt is None:
            add_generation_prompt = self.awaiting_reply
        text = self._render(add_generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
