"""Two chain proposers, one drafting where the other offers too little (``FIRST+SECOND``)."""

from __future__ import annotations

from collections.abc import Sequence

from kakeya_lab import inputs
from kakeya_lab.proposers.base import Draft, Proposer, check_proposer, is_tree_proposer


class FallbackProposer:
    """Drafts with ``first`` and, when it offers fewer than ``min_tokens`` tokens, with
    ``second`` instead (spec ``FIRST+SECOND``, e.g. ``suffix+draft:MODEL``: the suffix
    index's free drafts where the text repeats itself, the draft model elsewhere).

    ``accept(n)`` goes to the proposer whose draft was verified; ``observe_reply`` to both.
    A proposer that did not draft a step catches up at its next draft (each one syncs to
    the context it is given). Which proposer drafts depends only on the context, so
    rejection sampling stays exact. ``chosen`` lists, per draft, which one drafted it (0:
    ``first``, 1: ``second``); ``drafts`` counts them."""

    def __init__(self, first: Proposer, second: Proposer, *, min_tokens: int = 2):
        for part in (first, second):
            check_proposer(part)
            if is_tree_proposer(part):
                raise ValueError(f"FIRST+SECOND combines chain proposers, got {part.name!r}")
        self.first, self.second = first, second
        self.min_tokens = inputs.count(min_tokens, "min_tokens", minimum=1)
        self.name = f"{first.name}+{second.name}"
        self.chosen: list[int] = []
        self._last: Proposer | None = None

    @property
    def drafts(self) -> list[int]:
        """How many drafts ``first`` and ``second`` made."""
        return [self.chosen.count(0), self.chosen.count(1)]

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        draft = self.first.propose(context, draft_length, sampling, generator)
        if len(draft.tokens) >= self.min_tokens:
            self._last = self.first
            self.chosen.append(0)
            return draft
        other = self.second.propose(context, draft_length, sampling, generator)
        self._last = self.second
        self.chosen.append(1)
        return Draft(other.tokens, other.probs, draft.seconds + other.seconds)

    def accept(self, n: int) -> None:
        if self._last is not None:
            self._last.accept(n)
        self._last = None

    def observe_reply(self, token_ids: Sequence[int]) -> None:
        for part in (self.first, self.second):
            observe = getattr(part, "observe_reply", None)
            if callable(observe):
                observe(token_ids)

    def describe(self) -> dict:
        parts: list[dict] = [getattr(p, "describe", dict)() for p in (self.first, self.second)]
        return {
            "name": self.name,
            "first": parts[0],
            "second": parts[1],
            "min_tokens": self.min_tokens,
            "drafts": self.drafts,
        }
