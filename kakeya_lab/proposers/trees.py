"""Tree proposers: n-gram and suffix drafts as :class:`~kakeya_lab.tree.DraftTree`s
(``ngram-tree``, ``suffix-tree``), and any chain proposer as a 1-wide tree (``tree:SPEC``,
:class:`ChainTree`).

Both expand a tree best-first (EAGLE-2 style, by the drafter's confidence) under a node
budget, the decoder's draft length: every candidate child carries a score, the highest
scored candidate becomes the next node (so parents are stored before children), and its
own children become candidates.

* :class:`NgramTreeProposer` — prompt lookup over *every* earlier occurrence of the
  history's last n-gram, for every n-gram size (largest first, newest first, at most
  ``max_occurrences`` inside the lookback): the continuations that followed them form a
  trie, a node scored by the longest n-gram that led to it, then by how many occurrences
  pass through it, then by recency. When the longest n-gram occurs once, the chain
  :class:`NgramProposer` drafts is the tree's first path.
* :class:`SuffixTreeProposer` — the suffix index of :class:`~kakeya_lab.proposers.suffix.SuffixProposer`:
  a node's children are the ``branch`` most frequent continuations of the longest
  matching suffix of ``context + path``, scored by the path's estimated probability (the
  product of ``count / total`` along it), kept while it is at least ``min_probability``
  and the path no longer than ``max_spec_factor × matched length``.

Both keep their chain ``propose`` (they are the chain proposers they extend) and are
deterministic (``probs`` None), so greedy and rejection-sampling decoders take them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Any

from kakeya_lab import inputs
from kakeya_lab.proposers.base import Draft, Proposer, check_proposer
from kakeya_lab.proposers.ngram import NgramProposer
from kakeya_lab.proposers.registry import ProposerRequest
from kakeya_lab.proposers.suffix import SuffixProposer
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.tree import DraftTree


class NgramTreeProposer(NgramProposer):
    """Prompt lookup as a tree over all recent occurrences (see the module doc)."""

    name = "ngram_tree"

    def __init__(
        self,
        ngram_sizes: Sequence[int] = (3, 2, 1),
        max_lookback: int | None = None,
        check_tokens: int = 64,
        *,
        max_depth: int = 8,
        max_occurrences: int = 16,
    ):
        super().__init__(ngram_sizes, max_lookback, check_tokens)
        self.max_depth = inputs.count(max_depth, "max_depth", minimum=1, maximum=inputs.MAX_SIZE)
        self.max_occurrences = inputs.count(max_occurrences, "max_occurrences", minimum=1)

    def _occurrences(self) -> list[tuple[int, int]]:
        """``(n, start)`` of the continuations of the latest occurrences of the history's
        last n-gram for every size ``n`` (largest first, newest first; a start found
        with a larger ``n`` is not repeated), at most ``max_occurrences``."""
        seen, length = self._seen, len(self._seen)
        window = length if self.max_lookback is None else min(length, self.max_lookback)
        out: list[tuple[int, int]] = []
        taken: set[int] = set()
        for n in self.ngram_sizes:
            if window <= n:
                continue
            ends = self._ends[n].get(tuple(seen[length - n :]))
            self.work += 1
            for e in reversed(ends or ()):
                if len(out) >= self.max_occurrences or e - n < length - window:
                    break
                if e not in taken:
                    taken.add(e)
                    out.append((n, e))
        return out

    def propose_tree(
        self,
        context: Sequence[int],
        max_nodes: int,
        sampling: SamplingConfig | None = None,
        generator=None,
    ) -> DraftTree:
        """A tree of at most ``max_nodes`` nodes continuing ``context`` (possibly empty)."""
        self._sync(context)
        seen = self._seen
        # trie of continuations: node -> {token: child}; per node its count and recency
        kids: list[dict[int, int]] = [{}]  # node 0 is the context itself
        best_n, count, recency, token_of = [0], [0], [0], [-1]
        for rank, (n, start) in enumerate(self._occurrences()):
            node = 0
            for token in seen[start : start + self.max_depth]:
                child = kids[node].get(token)
                if child is None:
                    child = kids[node][token] = len(kids)
                    kids.append({})
                    best_n.append(n)
                    count.append(0)
                    recency.append(rank)
                    token_of.append(token)
                count[child] += 1
                node = child
                self.work += 1

        def key(c: int) -> tuple[int, int, int]:  # longer match, then more often, then newer
            return (-best_n[c], -count[c], recency[c])

        tokens: list[int] = []
        parents: list[int] = []
        order = itertools.count()
        heap = [(key(c), next(order), c, -1) for c in kids[0].values()]
        heapq.heapify(heap)
        while heap and len(tokens) < max_nodes:
            _, _, trie_node, parent = heapq.heappop(heap)
            tokens.append(token_of[trie_node])
            parents.append(parent)
            here = len(tokens) - 1
            for c in kids[trie_node].values():
                heapq.heappush(heap, (key(c), next(order), c, here))
        return DraftTree(tokens, parents)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "max_depth": self.max_depth,
            "max_occurrences": self.max_occurrences,
        }


class SuffixTreeProposer(SuffixProposer):
    """The suffix proposer drafting trees (see the module doc); ``branch`` bounds the
    children tried per node."""

    name = "suffix_tree"

    def __init__(self, *, branch: int = 3, **options: Any):
        super().__init__(**options)  # the suffix proposer's own options, checked there
        self.branch = inputs.count(branch, "branch", minimum=1, maximum=inputs.MAX_SIZE)

    def propose_tree(
        self,
        context: Sequence[int],
        max_nodes: int,
        sampling: SamplingConfig | None = None,
        generator=None,
    ) -> DraftTree:
        """A tree of at most ``max_nodes`` nodes continuing ``context`` (possibly empty)."""
        self._sync(context)
        tail = self._seen[-self.max_depth :]
        matched, row = self._longest_match(tail)
        if not matched:
            return DraftTree.empty()
        max_len = math.ceil(self.max_spec_factor * matched)
        order = itertools.count()
        heap: list[tuple[float, int, int, int, list[int], int]] = []

        def push(parent: int, ctx: list[int], row: dict, probability: float, depth: int) -> None:
            if depth >= max_len:
                return
            total = sum(c for c, _ in row.values())
            for token in sorted(row, key=row.__getitem__, reverse=True)[: self.branch]:
                p = probability * row[token][0] / total
                if p >= self.min_probability:
                    heapq.heappush(heap, (-p, next(order), parent, token, ctx, depth))

        push(-1, tail, row, 1.0, 0)
        tokens: list[int] = []
        parents: list[int] = []
        while heap and len(tokens) < max_nodes:
            neg_p, _, parent, token, ctx, depth = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            ctx = (ctx + [token])[-self.max_depth :]
            _, row = self._longest_match(ctx)
            if row:
                push(len(tokens) - 1, ctx, row, -neg_p, depth + 1)
        return DraftTree(tokens, parents)

    def describe(self) -> dict:
        return {**super().describe(), "branch": self.branch}


class ChainTree:
    """Any chain proposer as a 1-wide tree proposer (the tree path with chain drafts;
    proposal distributions are kept, so rejection sampling works as for chains). Other
    attributes (``bind``, ``observe_reply``, ``verifier``...) are the wrapped proposer's."""

    def __init__(self, proposer: Proposer):
        check_proposer(proposer)
        self.proposer = proposer
        self.name = f"tree:{proposer.name}"

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        return self.proposer.propose(context, draft_length, sampling, generator)

    def propose_tree(self, context, max_nodes, sampling=None, generator=None) -> DraftTree:
        draft = self.proposer.propose(context, max_nodes, sampling, generator)
        tokens = list(draft.tokens)[:max_nodes]
        probs = None if draft.probs is None else draft.probs[: len(tokens)]
        return DraftTree.chain(tokens, probs)

    def accept(self, n: int) -> None:
        self.proposer.accept(n)

    def describe(self) -> dict:
        inner = self.proposer.describe() if hasattr(self.proposer, "describe") else {}
        return {**inner, "name": self.name, "tree": "chain"}

    def __getattr__(self, name: str):
        if name == "proposer":  # not set yet (e.g. during copying): no recursion
            raise AttributeError(name)
        return getattr(self.proposer, name)


def build_ngram_tree(argument: str, request: ProposerRequest) -> NgramTreeProposer:
    """``ngram-tree[:SIZES]`` (default sizes 3, 2, 1)."""
    return NgramTreeProposer([int(n) for n in argument.split(",")] if argument else [3, 2, 1])


def build_suffix_tree(argument: str, request: ProposerRequest) -> SuffixTreeProposer:
    """``suffix-tree[:DEPTH]`` (default depth 8), sharing the request's ``shared_replies``."""
    return SuffixTreeProposer(
        max_depth=int(argument) if argument else 8, shared=request.shared_replies
    )


def build_chain_tree(argument: str, request: ProposerRequest) -> ChainTree:
    """``tree:SPEC``: the chain proposer ``SPEC`` as a 1-wide tree."""
    return ChainTree(request.build(argument))
