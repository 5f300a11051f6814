"""Prompt lookup (``ngram[:SIZES]``): drafts the tokens that followed the latest earlier
occurrence of the history's last n-gram. No model; runs on either backend."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kakeya_lab import inputs
from kakeya_lab.errors import InputTypeError
from kakeya_lab.proposers.base import Draft
from kakeya_lab.proposers.registry import ProposerRequest


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the history's last n-gram
    (largest n first) and propose the tokens that followed it.

    Incremental: an index ``n-gram -> end positions`` is updated with only the tokens of
    ``context`` that are new since the last call, so a step costs O(new tokens +
    ``check_tokens``), not O(history). Contract: ``context`` differs from what the
    proposer saw only in its last ``check_tokens // 2`` positions, or from much further
    back (a session's history changes only at its end: a rollback of a few rejected
    drafts, then new tokens; a different session is a different history). The last
    ``check_tokens`` shared positions are compared: a disagreement in their later half
    truncates the index to the common prefix, one in the earlier half rebuilds it from
    ``context`` (O(history), rare). Drafts are
    those of an exhaustive search over the history (``tests/test_ngram.py``).
    ``work`` counts the tokens compared and indexed (for tests of the per-step cost).
    """

    name = "ngram"

    def __init__(
        self,
        ngram_sizes: Sequence[int] = (3, 2, 1),
        max_lookback: int | None = None,
        check_tokens: int = 64,
    ):
        if isinstance(ngram_sizes, (str, bytes)) or not hasattr(ngram_sizes, "__iter__"):
            raise InputTypeError(
                f"ngram_sizes must be a sequence of integers >= 1, got {ngram_sizes!r}"
            )
        sizes = sorted(
            {inputs.count(n, "an n-gram size", minimum=1) for n in ngram_sizes}, reverse=True
        )
        if not sizes:
            raise ValueError("ngram_sizes is empty: give at least one n-gram size, e.g. (3, 2, 1)")
        self.ngram_sizes = sizes
        if max_lookback is not None:
            max_lookback = inputs.count(max_lookback, "max_lookback", minimum=1)
        self.max_lookback = max_lookback
        self.check_tokens = inputs.count(check_tokens, "check_tokens", minimum=1)
        self._seen: list[int] = []  # the history the index describes
        # per n: n-gram -> end positions (ascending) of its occurrences ending at <= len(seen) - 1
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.work = 0

    def _truncate(self, length: int) -> None:
        """Forget every token from position ``length`` on (and the n-grams ending there)."""
        seen = self._seen
        for e in range(len(seen) - 1, length - 1, -1):  # ends no longer <= length - 1
            for n in self.ngram_sizes:
                if e - n >= 0:
                    key = tuple(seen[e - n : e])
                    ends = self._ends[n][key]
                    ends.pop()
                    if not ends:
                        del self._ends[n][key]
                    self.work += 1
        del seen[length:]

    def _extend(self, new: Sequence[int]) -> None:
        seen = self._seen
        for token in new:
            e = len(seen)  # the n-grams ending at e (exclusive) become "earlier" once token follows
            for n in self.ngram_sizes:
                if e - n >= 0:
                    self._ends[n].setdefault(tuple(seen[e - n : e]), []).append(e)
                    self.work += 1
            seen.append(int(token))

    def _sync(self, context: Sequence[int]) -> None:
        seen = self._seen
        common = min(len(seen), len(context))
        lo = max(0, common - self.check_tokens)
        for i in range(lo, common):
            self.work += 1
            if context[i] != seen[i]:
                common = i
                break
        if (
            lo > 0 and common - lo < self.check_tokens // 2
        ):  # differs too far back: not an edit at the end
            common = 0
        self.work += 1
        if common < len(seen):
            if common == 0:
                self._seen, self._ends = [], {n: {} for n in self.ngram_sizes}
            else:
                self._truncate(common)
        self._extend(context[len(self._seen) :])

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        t0 = time.perf_counter()
        self._sync(context)
        seen, length = self._seen, len(self._seen)
        window = length if self.max_lookback is None else min(length, self.max_lookback)
        tokens: list[int] = []
        if draft_length >= 1:
            for n in self.ngram_sizes:
                if window <= n:
                    continue
                ends = self._ends[n].get(tuple(seen[length - n :]))
                self.work += 1
                if (
                    ends and ends[-1] - n >= length - window
                ):  # the latest occurrence, inside the lookback
                    tokens = seen[ends[-1] : ends[-1] + draft_length]
                    break
        return Draft(tokens=tokens, probs=None, seconds=time.perf_counter() - t0)

    def accept(self, n: int) -> None:
        return None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "ngram_sizes": self.ngram_sizes,
            "max_lookback": self.max_lookback,
        }


def build(argument: str, request: ProposerRequest) -> NgramProposer:
    """``ngram[:SIZES]`` (default sizes 3, 2, 1)."""
    return NgramProposer([int(n) for n in argument.split(",")] if argument else (3, 2, 1))
