"""Draft proposers for speculative decoding (docs/design.md, "Proposers and speculative
decoding"): one module per method and a registry of kinds that every entry point reads.

* :mod:`~kakeya_lab.proposers.base` — the draft and the chain and tree protocols.
* :mod:`~kakeya_lab.proposers.registry` — :class:`ProposerKind`, :func:`register_proposer`,
  :func:`make_proposer`, :func:`check_proposer_spec`; the package's own kinds are declared
  in :mod:`~kakeya_lab.proposers.builtin`.
* Methods: :mod:`~kakeya_lab.proposers.ngram` (prompt lookup),
  :mod:`~kakeya_lab.proposers.suffix` (suffix index over the history and shared replies),
  :mod:`~kakeya_lab.proposers.draft_model` (a smaller model),
  :mod:`~kakeya_lab.proposers.early_exit` (the verifier's first layers),
  :mod:`~kakeya_lab.proposers.fallback` (``FIRST+SECOND``),
  :mod:`~kakeya_lab.proposers.trees` (draft trees), and
  :mod:`~kakeya_lab.proposers.drafters` (trained drafters: networks, checkpoints, the
  store's named drafters, their proposers).

Importing this package imports no tensor library; a method's module (and torch) is
imported when one of its names is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kakeya_lab.proposers.base import (
    Draft,
    Proposer,
    TokenizerMismatch,
    TreeProposer,
    check_proposer,
    check_same_tokenizer,
    is_tree_proposer,
)
from kakeya_lab.proposers.registry import (
    ProposerKind,
    ProposerRequest,
    check_proposer_spec,
    make_proposer,
    proposer_kind,
    proposer_kinds,
    register_proposer,
    unregister_proposer,
    usage,
)

_LAZY = {
    "NgramProposer": "ngram",
    "SuffixProposer": "suffix",
    "SharedReplies": "suffix",
    "SuffixIndex": "suffix",
    "DraftModelProposer": "draft_model",
    "EarlyExitProposer": "early_exit",
    "early_exit_model": "early_exit",
    "FallbackProposer": "fallback",
    "ChainTree": "trees",
    "NgramTreeProposer": "trees",
    "SuffixTreeProposer": "trees",
    "draft_model_spec": "builtin",
}

if TYPE_CHECKING:
    from kakeya_lab.proposers.builtin import draft_model_spec
    from kakeya_lab.proposers.draft_model import DraftModelProposer
    from kakeya_lab.proposers.early_exit import EarlyExitProposer, early_exit_model
    from kakeya_lab.proposers.fallback import FallbackProposer
    from kakeya_lab.proposers.ngram import NgramProposer
    from kakeya_lab.proposers.suffix import SharedReplies, SuffixIndex, SuffixProposer
    from kakeya_lab.proposers.trees import ChainTree, NgramTreeProposer, SuffixTreeProposer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ChainTree",
    "Draft",
    "DraftModelProposer",
    "EarlyExitProposer",
    "FallbackProposer",
    "NgramProposer",
    "NgramTreeProposer",
    "Proposer",
    "ProposerKind",
    "ProposerRequest",
    "SharedReplies",
    "SuffixIndex",
    "SuffixProposer",
    "SuffixTreeProposer",
    "TokenizerMismatch",
    "TreeProposer",
    "check_proposer",
    "check_proposer_spec",
    "check_same_tokenizer",
    "draft_model_spec",
    "early_exit_model",
    "is_tree_proposer",
    "make_proposer",
    "proposer_kind",
    "proposer_kinds",
    "register_proposer",
    "unregister_proposer",
    "usage",
]
