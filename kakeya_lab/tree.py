"""Draft trees: candidate continuations sharing prefixes, verified in one forward.

A :class:`DraftTree` holds token ids and, per node, the index of its parent (``-1``: the
node continues the context directly). Storage order puts every parent before its
children, so any prefix of the storage order is itself a tree. A node's *path* is the
chain of its ancestors and itself; its *depth* is the path's length minus one.

Verifying a tree (docs/design.md, "Draft trees"): the block fed to the verifier is the
tree *rooted* at ``x``, the last emitted token (:meth:`DraftTree.rooted`). Node ``i`` sits at
position ``next_position + depth(i)`` (RoPE by depth) and attends to the committed cache
under the sink-window visibility rule and, inside the block, only to its own ancestors
(:meth:`DraftTree.ancestor_mask`, applied on top of the visibility rule). Its logits are
then those of the sequence ``context + path(i)``. Siblings hold distinct tokens (a
repeated sibling would be verified twice for nothing and would break the acceptance rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kakeya_lab import inputs


@dataclass(frozen=True)
class DraftTree:
    """``tokens[i]`` with parent ``parents[i]`` (``-1``: a root). ``probs`` (optional,
    ``[len, vocab]``): the proposal distribution ``q`` each node was drawn from given its
    parent's path (``None``: deterministic drafts). Validated on construction:
    ValueError/TypeError say what is wrong."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: torch.Tensor | None = field(default=None, compare=False)

    def __init__(
        self,
        tokens: Sequence[int],
        parents: Sequence[int],
        probs: torch.Tensor | None = None,
    ):
        toks = tuple(_as_int(t, "token id") for t in tokens)
        pars = tuple(_as_int(p, "parent index") for p in parents)
        if len(toks) != len(pars):
            raise ValueError(
                f"a draft tree needs one parent per token: {len(toks)} tokens, {len(pars)} parents"
            )
        for i, p in enumerate(pars):
            if not -1 <= p < i:
                raise ValueError(
                    f"node {i} has parent {p}: a parent must be -1 (a root) or an earlier node "
                    "(store parents before children; this also rules out cycles)"
                )
        seen: set[tuple[int, int]] = set()
        for i, (t, p) in enumerate(zip(toks, pars)):
            if t < 0:
                raise ValueError(f"node {i} has a negative token id {t}")
            if (p, t) in seen:
                raise ValueError(f"node {i} repeats token {t} among the children of node {p}")
            seen.add((p, t))
        if probs is not None:
            if not isinstance(probs, torch.Tensor) or probs.ndim != 2 or len(probs) != len(toks):
                raise ValueError("probs must be a [nodes, vocab] tensor (one row per node) or None")
            if any(sum(1 for q in pars if q == p) > 1 for p in set(pars)):
                raise ValueError(
                    "proposal distributions are supported on 1-wide trees (chains) only: "
                    "a branching tree must be deterministic (probs=None)"
                )
        object.__setattr__(self, "tokens", toks)
        object.__setattr__(self, "parents", pars)
        object.__setattr__(self, "probs", probs)

    # ------------------------------------------------------------- builders
    @classmethod
    def chain(cls, tokens: Sequence[int], probs: torch.Tensor | None = None) -> DraftTree:
        """A 1-wide tree: each token continues the previous one."""
        return cls(tokens, list(range(-1, len(tokens) - 1)), probs)

    @classmethod
    def empty(cls) -> DraftTree:
        return cls((), ())

    def rooted(self, root_token: int) -> DraftTree:
        """The verifier block: ``root_token`` as node 0, this tree's roots as its children."""
        return DraftTree(
            (root_token, *self.tokens),
            (-1, *(p + 1 for p in self.parents)),
            None if self.probs is None else torch.cat([self.probs[:1] * 0, self.probs]),
        )

    def pruned(self, max_nodes: int, max_depth: int) -> DraftTree:
        """The first ``max_nodes`` nodes (storage order) of depth < ``max_depth`` (a tree:
        dropping a node drops its descendants)."""
        keep: dict[int, int] = {}
        depths = self.depths()
        for i, p in enumerate(self.parents):
            if len(keep) >= max_nodes:
                break
            if depths[i] < max_depth and (p == -1 or p in keep):
                keep[i] = len(keep)
        order = list(keep)
        return DraftTree(
            [self.tokens[i] for i in order],
            [keep[self.parents[i]] if self.parents[i] >= 0 else -1 for i in order],
            None if self.probs is None else self.probs[order],
        )

    # ------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return out

    @property
    def depth(self) -> int:
        """Nodes on the longest path (0 for an empty tree)."""
        return max(self.depths(), default=-1) + 1

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (``-1``: the roots), in storage order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Node indices from a root down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def is_path(self, nodes: Sequence[int]) -> bool:
        """Whether ``nodes`` goes from a root down parent to child (empty: yes)."""
        prev = -1
        for n in nodes:
            if not isinstance(n, int) or not 0 <= n < len(self) or self.parents[n] != prev:
                return False
            prev = n
        return True

    def ancestor_mask(self) -> torch.Tensor:
        """``[n, n]`` bool: ``mask[i, j]`` iff node ``j`` is on node ``i``'s path."""
        n = len(self)
        mask = torch.zeros((n, n), dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError if a token id is outside ``0..vocab_size-1``."""
        if self.tokens:
            inputs.token_ids(list(self.tokens), vocab_size, name="draft tree token ids")


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
            return int(value)
        raise TypeError(f"a draft tree's {what} must be an int, got {value!r}")
    return int(value)
