"""A trained drafter as a proposer: :class:`DrafterProposer` drafts chains with any drafter
of :mod:`kakeya_lab.proposers.drafters.network` (``drafter:NAME``), and
:class:`DrafterTreeProposer` EAGLE-2 trees with a feature drafter (``drafter-tree:NAME``).
Both bind to the session's verifier to read its hidden-state trace.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from kakeya_lab import inputs
from kakeya_lab.proposers.base import Draft
from kakeya_lab.proposers.drafters.network import Drafter, FeatureDrafter
from kakeya_lab.proposers.registry import ProposerRequest
from kakeya_lab.sampling import GREEDY
from kakeya_lab.tree import DraftTree
from kakeya_lab.verifier import HiddenTrace, Verifier

if TYPE_CHECKING:
    from kakeya_lab.proposers.drafters.lora import LoraDrafter


class DrafterProposer:
    """A trained (or untrained) drafter as a speculative-decoding proposer.

    ``bind(verifier)`` (called by the decoder) turns on the verifier's hidden-state trace;
    until the trace holds the feature of the latest committed token the proposer drafts
    nothing, so the step is a plain one.
    """

    def __init__(self, drafter: Drafter, label: str | None = None):
        self.drafter = drafter
        self.name = f"{drafter.config.kind}_drafter"
        self.label = label or self.name
        self.trace: HiddenTrace | None = None

    def bind(self, verifier: Verifier) -> None:
        c = self.drafter.config
        self.trace = verifier.trace_hidden(c.context_len + 2 * c.block_size + 64)

    def propose(self, context, draft_length, sampling=GREEDY, generator=None) -> Draft:
        t0 = time.perf_counter()
        held = self._context(context) if draft_length >= 1 else None
        if held is None:
            return Draft([], None, time.perf_counter() - t0)
        feats, next_tokens = held
        tokens, probs = self.drafter.draft(
            feats,
            next_tokens,
            draft_length,
            sampling if sampling is not None else GREEDY,
            generator,
        )
        return Draft(tokens, probs, time.perf_counter() - t0)

    def accept(self, n: int) -> None:
        return None

    def _context(self, context: Sequence[int]) -> tuple[torch.Tensor, list[int]] | None:
        """The latest held features and the tokens that followed them, or None."""
        context = list(context)
        history = context[:-1]  # committed; the last token is emitted but not yet scored
        trace = self.trace
        n = trace.held_suffix(history, self.drafter.config.context_len) if trace else 0
        if trace is None or n == 0:
            return None
        positions = range(len(history) - n, len(history))
        feats = trace.features(positions, [history[p] for p in positions])
        if feats is None:  # held_suffix counted them held, so not expected: draft nothing
            return None
        return feats, context[len(context) - n :]

    def describe(self) -> dict:
        c = self.drafter.config
        return {
            "name": self.name,
            "label": self.label,
            "kind": c.kind,
            "width": c.width,
            "num_layers": c.num_layers,
            "context_len": c.context_len,
            "block_size": c.block_size,
            "draft_vocab": len(c.draft_vocab),
        }


class DrafterTreeProposer(DrafterProposer):
    """A feature drafter drafting EAGLE-2 trees (:meth:`FeatureDrafter.draft_tree`); the
    decoder's draft length is the node budget, ``branch`` the children tried per node."""

    def __init__(self, drafter: FeatureDrafter, label: str | None = None, *, branch: int = 4):
        if not isinstance(drafter, FeatureDrafter):
            raise ValueError(
                f"draft trees need a feature drafter (it drafts one token per forward); "
                f"got a {drafter.config.kind} drafter"
            )
        super().__init__(drafter, label)
        self.name = "feature_drafter_tree"
        self.branch = inputs.count(branch, "branch", minimum=1, maximum=inputs.MAX_SIZE)

    def propose_tree(self, context, max_nodes, sampling=None, generator=None) -> DraftTree:
        held = self._context(context) if max_nodes >= 1 else None
        if held is None:
            return DraftTree.empty()
        feats, next_tokens = held
        return cast(FeatureDrafter, self.drafter).draft_tree(
            feats, next_tokens, max_nodes, self.branch
        )

    def describe(self) -> dict:
        return {**super().describe(), "tree": "eagle2", "branch": self.branch}


def _named(argument: str, request: ProposerRequest):
    """The named drafter ``argument``: the request's already loaded one, else from the store."""
    if request.drafters and argument in request.drafters:
        return request.drafters[argument]
    from kakeya_lab.proposers.drafters.named import load_named_drafter

    return load_named_drafter(argument, request.model, request.verifier_sha256)


def build_chain(argument: str, request: ProposerRequest) -> Any:
    """``drafter:NAME``: the named drafter ``NAME`` of the store, which must have been
    trained for the request's ``verifier_sha256``; a LoRA drafter drafts as a draft model
    with its own cache (merged here, unless the caller that shared the drafter in
    ``drafters`` also shared its merged model as ``draft_model``)."""
    drafter = _named(argument, request)
    if drafter.config.kind == "lora":
        from kakeya_lab.proposers.draft_model import DraftModelProposer

        lora = cast("LoraDrafter", drafter)
        shared = request.drafters is not None and argument in request.drafters
        merged = request.draft_model if shared and request.draft_model is not None else None
        if merged is None:
            merged = lora.draft_model()
        return DraftModelProposer(merged, request.config, label=argument)
    return DrafterProposer(cast(Drafter, drafter), label=argument)


def build_tree(argument: str, request: ProposerRequest) -> DrafterTreeProposer:
    """``drafter-tree:NAME``: the named feature drafter ``NAME`` drafting EAGLE-2 trees
    (ValueError for a drafter of another kind: only a feature drafter drafts trees)."""
    drafter = _named(argument, request)
    check_tree_drafter(argument, drafter)
    return DrafterTreeProposer(cast(FeatureDrafter, drafter), label=f"{argument} (tree)")


def check_tree_drafter(name: str, drafter: Any) -> None:
    """ValueError unless ``drafter`` (the named drafter ``name``) can draft trees."""
    if drafter.config.kind != "feature":
        raise ValueError(
            f"drafter-tree:{name}: only a feature drafter drafts trees, and {name!r} is a "
            f"{drafter.config.kind} drafter; use drafter:{name}"
        )
