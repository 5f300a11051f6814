"""Suffix proposer: SuffixDecoding-style drafts from continuation statistics, no model.

A :class:`SuffixIndex` counts, for every context of 1..``max_depth`` tokens seen in the
sequences added to it, which token followed and how often (the information a suffix
tree of depth ``max_depth`` holds at its nodes). :class:`SuffixProposer` keeps one index
over its own session's history (updated incrementally, rolled back when the history is
rewound) and may share a second index with every other proposer built on the same
:class:`SharedReplies` — the replies generated so far in a store, across sessions.

Drafting (a chain): match the longest suffix of the history present in either index,
take its most frequent continuation (frequencies of both indexes added; ties go to the
most recently seen token), append it to the matched context and repeat. The draft stops
when the product of the chosen tokens' frequencies (``count / total`` at each node, the
path's estimated probability) falls below ``min_probability``, or at
``max_spec_factor × matched length`` tokens (adaptive draft size: a long match earns a
long draft), or at the decoder's ``draft_length``. Drafts are deterministic (``probs``
is None), so the proposer serves greedy and rejection-sampling decoders alike; being a
pure function of token ids it runs unchanged on either backend.

Per-step cost: O(new tokens × ``max_depth``) to index plus O(draft × ``max_depth``) to
look up, independent of the history's length (``work`` counts index operations).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from kakeya_lab import inputs
from kakeya_lab.proposers.base import Draft
from kakeya_lab.proposers.registry import ProposerRequest
from kakeya_lab.sampling import SamplingConfig


class SuffixIndex:
    """Continuation statistics of every context of 1..``max_depth`` tokens.

    ``ends[context][token]``: the positions (ascending) at which ``token`` followed
    ``context`` — how often (the count) and how recently (the last position; ties
    between equal counts go to the token seen last).
    """

    def __init__(self, max_depth: int = 8):
        self.max_depth = inputs.count(max_depth, "max_depth", minimum=1, maximum=64)
        self.ends: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self.work = 0

    def add_at(self, seq: Sequence[int], position: int, stamp: int | None = None) -> None:
        """Count ``seq[position]`` as the continuation of its preceding contexts, recorded
        at ``stamp`` (default ``position``; stamps only ever grow)."""
        token = int(seq[position])
        stamp = position if stamp is None else stamp
        for n in range(1, min(self.max_depth, position) + 1):
            row = self.ends.setdefault(tuple(seq[position - n : position]), {})
            row.setdefault(token, []).append(stamp)
            self.work += 1

    def remove_at(self, seq: Sequence[int], position: int) -> None:
        """Undo the latest :meth:`add_at` of ``seq`` at ``position``."""
        token = int(seq[position])
        for n in range(1, min(self.max_depth, position) + 1):
            ctx = tuple(seq[position - n : position])
            row = self.ends[ctx]
            row[token].pop()
            if not row[token]:
                del row[token]
                if not row:
                    del self.ends[ctx]
            self.work += 1

    def __len__(self) -> int:
        return len(self.ends)


class SharedReplies:
    """One :class:`SuffixIndex` over the replies of many sessions (pass the same object to
    every :class:`SuffixProposer` of a store). ``replies`` counts the replies added."""

    def __init__(self, max_depth: int = 8):
        self.index = SuffixIndex(max_depth)
        self.replies = 0
        self.tokens = 0  # stamps: later replies are more recent

    def add_reply(self, token_ids: Sequence[int]) -> None:
        seq = [int(t) for t in token_ids]
        for position in range(1, len(seq)):
            self.index.add_at(seq, position, stamp=self.tokens + position)
        self.tokens += len(seq)
        self.replies += 1


class SuffixProposer:
    """Drafts from a suffix index over the session's own history and, if ``shared`` is
    given, over every reply generated through proposers sharing it (see the module doc).

    Contract on ``context`` (as for :class:`~kakeya_lab.proposers.NgramProposer`): it
    differs from what the proposer saw only in its last ``check_tokens // 2`` positions
    (a rollback at the end, then new tokens) or from much further back (a different
    session: the index is rebuilt). The decoder reports each finished reply through
    :meth:`observe_reply`, which adds it to ``shared``.
    """

    name = "suffix"

    def __init__(
        self,
        *,
        max_depth: int = 8,
        shared: SharedReplies | None = None,
        min_probability: float = 0.1,
        max_spec_factor: float = 2.0,
        min_match: int = 1,
        check_tokens: int = 64,
    ):
        self.max_depth = inputs.count(max_depth, "max_depth", minimum=1, maximum=64)
        if shared is not None and not isinstance(shared, SharedReplies):
            raise TypeError(f"shared must be a SharedReplies or None, got {type(shared).__name__}")
        self.shared = shared
        if not (isinstance(min_probability, (int, float)) and 0.0 <= min_probability < 1.0):
            raise ValueError(f"min_probability must be in [0, 1), got {min_probability!r}")
        if not (isinstance(max_spec_factor, (int, float)) and max_spec_factor > 0):
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor!r}")
        self.min_probability = float(min_probability)
        self.max_spec_factor = float(max_spec_factor)
        self.min_match = inputs.count(min_match, "min_match", minimum=1, maximum=self.max_depth)
        self.check_tokens = inputs.count(check_tokens, "check_tokens", minimum=2)
        self.index = SuffixIndex(self.max_depth)
        self._seen: list[int] = []

    @property
    def work(self) -> int:
        """Index operations so far (own index; the shared one counts its own)."""
        return self.index.work

    # ------------------------------------------------------------- history sync
    def _sync(self, context: Sequence[int]) -> None:
        seen = self._seen
        common = min(len(seen), len(context))
        lo = max(0, common - self.check_tokens)
        for i in range(lo, common):
            if context[i] != seen[i]:
                common = i
                break
        if lo > 0 and common - lo < self.check_tokens // 2:  # not an edit at the end
            common = 0
        if common == 0 and seen:
            self.index = SuffixIndex(self.max_depth)
            seen.clear()
        for position in range(len(seen) - 1, common - 1, -1):
            self.index.remove_at(seen, position)
        del seen[common:]
        for token in context[common:]:
            seen.append(int(token))
            self.index.add_at(seen, len(seen) - 1)

    # --------------------------------------------------------------- drafting
    def _continuations(self, ctx: tuple[int, ...]) -> dict[int, tuple[int, tuple[bool, int]]]:
        """token -> (count, recency) over both indexes; the own history is more recent
        than any shared reply."""
        out: dict[int, tuple[int, tuple[bool, int]]] = {}
        if self.shared is not None:
            for token, ends in self.shared.index.ends.get(ctx, {}).items():
                out[token] = (len(ends), (False, ends[-1]))
        for token, ends in self.index.ends.get(ctx, {}).items():
            count = len(ends) + (out[token][0] if token in out else 0)
            out[token] = (count, (True, ends[-1]))
        return out

    def _longest_match(self, tail: list[int]) -> tuple[int, dict]:
        for n in range(min(self.max_depth, len(tail)), self.min_match - 1, -1):
            row = self._continuations(tuple(tail[len(tail) - n :]))
            if row:
                return n, row
        return 0, {}

    def propose(
        self,
        context: Sequence[int],
        draft_length: int,
        sampling: SamplingConfig | None = None,
        generator=None,
    ) -> Draft:
        """Up to ``draft_length`` tokens continuing ``context`` (possibly none)."""
        t0 = time.perf_counter()
        self._sync(context)
        tail = self._seen[-self.max_depth :]
        tokens: list[int] = []
        matched, row = self._longest_match(tail)
        cap = min(draft_length, math.ceil(self.max_spec_factor * matched)) if matched else 0
        probability = 1.0
        while row and len(tokens) < cap:
            token = max(row, key=row.__getitem__)  # most frequent, then most recent
            probability *= row[token][0] / sum(count for count, _ in row.values())
            if probability < self.min_probability:
                break
            tokens.append(token)
            tail = (tail + [token])[-self.max_depth :]
            _, row = self._longest_match(tail)
        return Draft(tokens=tokens, probs=None, seconds=time.perf_counter() - t0)

    def accept(self, n: int) -> None:
        return None  # drafts never enter the index: the next context says what was kept

    def observe_reply(self, token_ids: Sequence[int]) -> None:
        """A reply the decoder delivered; added to the shared index (if any)."""
        if self.shared is not None and len(token_ids) > 1:
            self.shared.add_reply(token_ids)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "max_depth": self.max_depth,
            "min_probability": self.min_probability,
            "max_spec_factor": self.max_spec_factor,
            "min_match": self.min_match,
            "shared_replies": self.shared.replies if self.shared is not None else None,
        }


def build(argument: str, request: ProposerRequest) -> SuffixProposer:
    """``suffix[:DEPTH]`` (default depth 8), sharing the request's ``shared_replies``."""
    return SuffixProposer(max_depth=int(argument) if argument else 8, shared=request.shared_replies)
