"""The one streaming detokenizer: the text of a growing reply, delta by delta.

Every consumer that shows tokens as they arrive (the HTTP and gRPC streams, the chat
panel, the chat command) uses :class:`StreamingDetokenizer`, so they agree on when text
appears: never in the middle of a UTF-8 sequence, and joined over a reply it is the reply
decoded at once.
"""

from __future__ import annotations

from collections.abc import Callable, Collection


class StreamingDetokenizer:
    """The text of a growing reply, delta by delta.

    Each token re-decodes only the tokens since the text last grew (plus the token before
    them, so a tokenizer that strips a leading space does it to both decodes alike), not
    the whole reply: O(n) for n tokens. Text ending in an incomplete UTF-8 sequence waits
    for the next token. ``decode`` maps token ids to text.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # the window's start
        self.read = 0  # tokens whose text has been returned

    @classmethod
    def for_tokenizer(
        cls, tokenizer, *, skip_ids: Collection[int] = (), skip_special_tokens: bool = True
    ) -> StreamingDetokenizer:
        """A detokenizer over a Hugging Face ``tokenizer``'s ``decode``; ``skip_ids`` (e.g.
        the end-of-sequence ids) never show as text."""
        skip = frozenset(skip_ids)

        def decode(ids: list[int]) -> str:
            kept = [t for t in ids if t not in skip] if skip else ids
            return tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)

        return cls(decode)

    def add(self, token_id: int) -> str:
        """Append ``token_id``; the new text it completes ("" if none yet)."""
        self.ids.append(token_id)
        shown = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(shown):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown) :]


def text_pieces(decode: Callable[[list[int]], str], ids: list[int]) -> list[str]:
    """The text each of ``ids`` adds, streamed with :class:`StreamingDetokenizer`; joined,
    exactly ``decode(ids)`` (if a later token re-decodes earlier text, the whole text is the
    first piece and the rest are empty)."""
    detok = StreamingDetokenizer(decode)
    pieces = [detok.add(t) for t in ids]
    full = decode(ids)
    if "".join(pieces) != full:
        pieces = [full] + [""] * (len(ids) - 1) if ids else []
    return pieces
