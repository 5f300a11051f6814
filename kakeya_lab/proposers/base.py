"""What a proposer is: the draft, the chain and tree protocols, and their checks.

Protocol: ``propose(context, draft_length, sampling, generator=None) -> Draft`` where
``context`` is the session's token history so far (every token the verifier has accepted
or emitted), ``sampling`` a :class:`~kakeya_lab.sampling.SamplingConfig` (greedy drafts
when it is greedy) and ``generator`` the random source to draw from; ``accept(n)`` tells
the proposer how many of its last draft's tokens were accepted, so it can roll back its
own state. A proposer keeps whatever state it wants but must resynchronise from
``context`` alone: if its own history is not a prefix of ``context`` it starts over.
A proposer that conditions on the verifier's hidden states may also define
``bind(verifier)``; the decoder calls it before the first draft (see
:class:`kakeya_lab.proposers.drafters.proposer.DrafterProposer`), and one that learns from
finished replies ``observe_reply(token_ids)`` (the decoder calls it once per reply; see
:class:`kakeya_lab.proposers.suffix.SuffixProposer`). A tree proposer drafts a
:class:`~kakeya_lab.tree.DraftTree` instead (``propose_tree``).

This module imports no tensor library: a model-free proposer needs nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kakeya_lab.errors import InputTypeError

if TYPE_CHECKING:
    import torch

    from kakeya_lab.sampling import SamplingConfig
    from kakeya_lab.tree import DraftTree


@dataclass
class Draft:
    """``tokens`` drafted; ``probs[i]`` the proposal distribution ``q`` each was drawn from
    (``None``: deterministic drafts, i.e. one-hot ``q``); ``seconds`` spent drafting."""

    tokens: list[int]
    probs: torch.Tensor | None
    seconds: float


@runtime_checkable
class Proposer(Protocol):
    """A chain proposer: drafts a run of tokens after the context."""

    name: str

    def propose(
        self,
        context: Sequence[int],
        draft_length: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> Draft: ...

    def accept(self, n: int) -> None: ...

    def describe(self) -> dict: ...


@runtime_checkable
class TreeProposer(Protocol):
    """A proposer that drafts a :class:`~kakeya_lab.tree.DraftTree` of at most
    ``max_nodes`` nodes (the decoder's draft length is the node budget); ``accept(n)``
    then gets the accepted path's length."""

    name: str

    def propose_tree(
        self,
        context: Sequence[int],
        max_nodes: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> DraftTree: ...

    def accept(self, n: int) -> None: ...

    def describe(self) -> dict: ...


def is_tree_proposer(proposer: object) -> bool:
    """Whether the decoder should verify ``proposer``'s drafts as trees."""
    return callable(getattr(proposer, "propose_tree", None))


def check_proposer(proposer: object) -> None:
    """Raise ``TypeError`` unless ``proposer`` follows the :class:`Proposer` protocol."""
    if isinstance(proposer, str):
        raise InputTypeError(
            f"proposer must be a Proposer object, got the string {proposer!r}: "
            "build one with kakeya_lab.proposers.make_proposer(spec, model, config)"
        )
    missing = [m for m in ("propose", "accept") if not callable(getattr(proposer, m, None))]
    if missing:
        raise InputTypeError(
            f"proposer must follow the Proposer protocol (propose, accept, describe); "
            f"{type(proposer).__name__} lacks {', '.join(missing)}"
        )


class TokenizerMismatch(ValueError):
    """Proposer and verifier do not share a vocabulary."""


def check_same_tokenizer(draft_tokenizer: Any, verifier_tokenizer: Any) -> None:
    """Raise :class:`TokenizerMismatch` unless both map the same strings to the same ids."""
    if draft_tokenizer is None or verifier_tokenizer is None:
        return
    a, b = draft_tokenizer.get_vocab(), verifier_tokenizer.get_vocab()
    if a != b:
        only_a = len(set(a.items()) - set(b.items()))
        raise TokenizerMismatch(
            f"the proposer's tokenizer differs from the verifier's ({len(a)} vs {len(b)} entries, "
            f"{only_a} pairs differ): speculative decoding needs one shared vocabulary"
        )
