"""Incremental chat templating: token ids for the *new* part of a conversation only.

A session must append only each turn's new tokens. :class:`ChatTemplate` renders the whole
conversation with the tokenizer's own chat template, checks that what the session already
holds is a prefix of it, and returns the ids of the remainder. Concatenated over the turns,
these ids equal the tokenizer's template applied to the whole conversation, token for
token, generated replies included (``tests/test_chat_ids.py``, on the default model and the
Qwen tokenizer): a generated reply is held as the model's own ids, and the template's
end-of-turn tokens after it (:meth:`ChatTemplate.end_of_turn_ids`: ``<|im_end|>\n`` after a
reply cut by ``max_new_tokens``, only ``\n`` after one that stopped on ``<|im_end|>``) open
the next user delta.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Sequence


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
        text = self._decode(body)
        self.messages.append({"role": "assistant", "content": text})
        held = self.rendered + self._decode(ids)
        full = self._render(add_generation_prompt=False)
        if not full.startswith(held):
            self.messages.pop()
            raise ValueError(
                f"the reply ended with {self._decode(ids[-1:])!r}, which the chat template "
                "does not close an assistant turn with; pass the model's end-of-turn ids as "
                "eos_token_ids only if the template ends turns with them"
            )
        self.awaiting_reply = False
        self.rendered = held
        return text

    def _decode(self, ids: Sequence[int]) -> str:
        # no clean-up of spaces: the text must re-tokenize to the very ids the session holds
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def end_of_turn_ids(self) -> list[int]:
        """The template's ids after the last reply that the session does not hold yet (the
        next :meth:`user` delta starts with them). Empty while a reply is awaited."""
        if self.awaiting_reply or not self.messages:
            return []
        rest = self._render(add_generation_prompt=False)[len(self.rendered) :]
        return self.tokenizer(rest, add_special_tokens=False)["input_ids"]

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

    def replay(self, conversations: Iterable[Sequence[str]], limit: int) -> list[int]:
        """The ids of ``conversations`` (each a list of turns: user first, then alternating
        with the assistant) rendered one after another on this template, cut at ``limit``
        tokens (fewer if the conversations run out first): a real chat context to fill a
        cache with."""
        out: list[int] = []
        for turns in conversations:
            for i, text in enumerate(turns):
                out.extend(self.user(text) if i % 2 == 0 else self.assistant(text))
                if len(out) >= limit:
                    return out[:limit]
        return out

    def full_ids(self, add_generation_prompt: bool | None = None) -> list[int]:
        """The tokenizer's template over the whole conversation, as ids (the reference)."""
        if add_generation_prompt is None:
            add_generation_prompt = self.awaiting_reply
        text = self._render(add_generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
