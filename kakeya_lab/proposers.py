"""Draft proposers for speculative decoding (docs/design.md, "Proposers and speculative decoding").

Protocol: ``propose(context, draft_length, sampling, generator=None) -> Draft`` where
``context`` is the session's token history so far (every token the verifier has accepted
or emitted), ``sampling`` a :class:`~kakeya_lab.sampling.SamplingConfig` (greedy drafts
when it is greedy) and ``generator`` the random source to draw from; ``accept(n)`` tells
the proposer how many of its last draft's tokens were accepted, so it can roll back its
own state. A proposer keeps whatever state it wants but must resynchronise from
``context`` alone: if its own history is not a prefix of ``context`` it starts over.
A proposer that conditions on the verifier's hidden states may also define
``bind(verifier)``; the decoder calls it before the first draft (see
:class:`kakeya_lab.align.drafters.DrafterProposer`), and one that learns from finished
replies ``observe_reply(token_ids)`` (the decoder calls it once per reply; see
:class:`kakeya_lab.suffix.SuffixProposer`).

* :class:`NgramProposer` — prompt lookup over the history, no model.
* :class:`DraftModelProposer` — a smaller model sharing the tokenizer, with its own
  sink-window cache (drafts greedily or by sampling; rejected drafts are rolled back).
* :class:`~kakeya_lab.suffix.SuffixProposer` (in :mod:`kakeya_lab.suffix`) — suffix-index
  drafts over the history and shared replies, no model.
* :class:`EarlyExitProposer` — self-speculation: the verifier's first ``L`` layers with
  its final norm and lm_head, as a draft model sharing the verifier's weights.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch
from torch import nn
from transformers import PreTrainedModel

from kakeya_lab import inputs
from kakeya_lab.backends import registry
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.inputs import InputTypeError
from kakeya_lab.linear import linear_kernel_of
from kakeya_lab.proposer_spec import USAGE, check_proposer_spec, draft_model_spec
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.tree import DraftTree
from kakeya_lab.verifier import Verifier

if TYPE_CHECKING:
    from kakeya_lab.align.drafters import Drafter, FeatureDrafter
    from kakeya_lab.align.lora import LoraDrafter
    from kakeya_lab.backends.torch_lean import LeanForward


@dataclass
class Draft:
    """``tokens`` drafted; ``probs[i]`` the proposal distribution ``q`` each was drawn from
    (``None``: deterministic drafts, i.e. one-hot ``q``); ``seconds`` spent drafting."""

    tokens: list[int]
    probs: torch.Tensor | None
    seconds: float


@runtime_checkable
class Proposer(Protocol):
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


def check_same_tokenizer(draft_tokenizer, verifier_tokenizer) -> None:
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


class DraftModelProposer:
    """A draft model with its own sink-window cache.

    Drafts ``draft_length`` tokens autoregressively (greedy when ``sampling`` is greedy,
    else sampled from the same filtered distribution the verifier samples from). After ``accept(n)`` its
    cache keeps the accepted drafts and drops the rest. With ``lean`` (the default) a model
    :class:`~kakeya_lab.backends.torch_lean.LeanForward` supports runs its one-token steps through it
    (cheaper on CPU, rounded differently; ``describe()["forward"]`` says which ran).
    """

    name = "draft_model"

    def __init__(
        self,
        model: PreTrainedModel,
        config: SinkWindowConfig,
        *,
        tokenizer=None,
        verifier_tokenizer=None,
        label: str | None = None,
        lean: bool = True,
    ):
        check_same_tokenizer(tokenizer, verifier_tokenizer)
        self.model = model
        self.config = config
        self.label = (
            label
            or getattr(getattr(model, "config", None), "name_or_path", "")
            or type(model).__name__
        )
        self.lean = lean
        self.verifier = self._new_cache()
        self._next_logits: torch.Tensor | None = None
        self._rows: list[torch.Tensor] = []

    def _new_cache(self) -> Verifier:
        return Verifier(self.model, self.config, lean=self.lean)

    @property
    def lean_forward(self) -> LeanForward | None:
        """The draft cache's lean forward, if its backend runs one (else None)."""
        return getattr(self.verifier.backend, "lean_forward", None)

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Bring the draft cache to exactly ``context`` (all committed); the next logits."""
        v = self.verifier
        v.rollback()
        history = v.history_view()
        # A session's history only changes at its end, so comparing the last entries
        # tells an extension from a rewrite without reading the whole history each step.
        n = len(history)
        if n > len(context) or any(context[i] != history[i] for i in range(max(0, n - 64), n)):
            self.verifier = v = self._new_cache()
            n, self._next_logits = 0, None
        new = context[n:]
        if new:
            self._next_logits = v.append(new)
        if self._next_logits is None:
            raise ValueError("a draft needs a non-empty context")
        return self._next_logits

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        t0 = time.perf_counter()
        sampling = sampling if sampling is not None else SamplingConfig()
        logits = self._sync(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        self._rows = [logits]  # logits after context, then after each forwarded draft
        for i in range(draft_length):
            if sampling.greedy:
                token = int(torch.argmax(logits))
            else:
                q = sampling.probs(logits)
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            tokens.append(token)
            if i + 1 < draft_length:
                logits = self.verifier.forward_block([token])[-1]
                self._rows.append(logits)
        return Draft(
            tokens=tokens,
            probs=torch.stack(probs) if probs else None,
            seconds=time.perf_counter() - t0,
        )

    def accept(self, n: int) -> None:
        """Keep the first ``n`` drafted tokens in the draft cache (as far as they were forwarded)."""
        keep = min(n, self.verifier.pending_len)
        self.verifier.commit(keep)
        self._next_logits = self._rows[keep]

    def describe(self) -> dict:
        return {
            "name": self.name,
            "model": self.label,
            "cache": self.config.to_dict(),
            "forward": "lean" if self.lean_forward is not None else "transformers",
        }


def early_exit_model(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM made of ``model``'s embedding, first ``num_layers`` layers, final norm
    and lm_head — sharing the parameters (no copy)."""
    total = model.config.num_hidden_layers
    num_layers = inputs.count(
        num_layers,
        "num_layers",
        minimum=1,
        maximum=total - 1,
        hint=f"early exit keeps fewer than the model's {total} layers",
    )
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    with torch.device("meta"):
        draft = type(model)(cfg)
    base, sub = model.base_model, draft.base_model
    sub.embed_tokens = base.embed_tokens
    layers = cast(nn.ModuleList, base.layers)  # nn.Module attributes type as Tensor | Module
    sub.layers = nn.ModuleList(list(layers[:num_layers]))
    sub.norm = base.norm
    sub.rotary_emb = base.rotary_emb
    draft.lm_head = model.lm_head
    draft.generation_config = model.generation_config
    draft.eval()
    draft.set_attn_implementation(model.config._attn_implementation)
    return draft


class EarlyExitProposer(DraftModelProposer):
    """Self-speculation: the verifier's first ``num_layers`` layers draft for the whole model."""

    name = "early_exit"

    def __init__(self, model: PreTrainedModel, config: SinkWindowConfig, num_layers: int):
        self.num_layers = num_layers
        if registry.name_of(model) == "mlx":
            from kakeya_lab.backends.mlx_backend import mlx_early_exit_model

            draft = mlx_early_exit_model(model, num_layers)
        else:
            draft = early_exit_model(model, num_layers)
        super().__init__(draft, config, label=f"early-exit-{num_layers}")

    def describe(self) -> dict:
        return {"name": self.name, "num_layers": self.num_layers, "cache": self.config.to_dict()}


def make_proposer(
    spec: str | None,
    model: PreTrainedModel,
    config: SinkWindowConfig,
    tokenizer=None,
    *,
    draft_model=None,
    shared_replies=None,
    verifier_sha256: str | None = None,
    draft_linear: str | None = None,
    draft_window: int | None = None,
) -> Proposer | None:
    """Build a proposer from a short spec (CLI, notebooks, sweep files).

    ``none`` → ``None`` (plain decoding); ``ngram`` or ``ngram:3,2,1``; ``suffix`` or
    ``suffix:DEPTH`` (sharing ``shared_replies``, a
    :class:`~kakeya_lab.suffix.SharedReplies`, when given);
    ``early-exit:LAYERS``; tree proposers ``ngram-tree[:SIZES]`` and
    ``suffix-tree[:DEPTH]`` (:mod:`kakeya_lab.tree_proposers`; the draft length is their
    node budget) and ``tree:SPEC`` (any chain proposer above as a 1-wide tree);
    ``draft:MODEL[:KERNEL]`` (a registry name or local folder, loaded with
    :func:`~kakeya_lab.models.load_model` unless ``draft_model`` — an already loaded model,
    i.e. what ``load_model`` returns or a bare ``PreTrainedModel`` — is given, in the
    verifier's dtype and with ``KERNEL`` as its linear kernel, else ``draft_linear``, else
    the verifier's: ``int8`` or ``int4`` (quantised weights, e.g.
    ``draft:qwen2.5-coder-0.5b-instruct:int4``) make a draft model's steps cheaper on CPU,
    :mod:`kakeya_lab.linear`; its own sink-window cache keeps ``config``'s sinks and
    positions and ``draft_window`` recent entries, default ``config``'s window (a shorter
    one attends over fewer entries once the history outgrows it); its tokenizer must equal ``tokenizer``); ``drafter:NAME`` (a
    named drafter of the store, see :mod:`kakeya_lab.align.named`; needs ``verifier_sha256``, the verifier's
    ``LoadedModel.description.weight_sha256``, which must be the one it was trained for);
    ``drafter-tree:NAME`` (a named feature drafter drafting EAGLE-2 trees, the draft length
    being the node budget); ``FIRST+SECOND`` (two chain proposers above,
    :class:`FallbackProposer`: the second drafts when the first offers fewer than two
    tokens, e.g. ``suffix+draft:MODEL``)."""
    if spec is not None and not isinstance(spec, str):
        raise InputTypeError(
            f"proposer spec must be a string or None, got {type(spec).__name__} ({USAGE})"
        )
    check_proposer_spec(spec)  # the grammar, before anything loads
    if spec in (None, "", "none"):
        return None
    assert spec is not None

    def part(sub: str) -> Proposer | None:  # a spec inside this one, with the same context
        return make_proposer(
            sub,
            model,
            config,
            tokenizer,
            draft_model=draft_model,
            shared_replies=shared_replies,
            verifier_sha256=verifier_sha256,
            draft_linear=draft_linear,
            draft_window=draft_window,
        )

    if "+" in spec:  # FIRST+SECOND: the second drafts when the first offers too little
        first, _, second = spec.partition("+")
        return FallbackProposer(cast(Proposer, part(first)), cast(Proposer, part(second)))
    kind, _, arg = spec.partition(":")
    if kind == "tree":  # any chain proposer verified as a 1-wide tree
        return ChainTree(cast(Proposer, part(arg)))
    if kind == "suffix-tree":
        from kakeya_lab.tree_proposers import SuffixTreeProposer

        return SuffixTreeProposer(max_depth=int(arg) if arg else 8, shared=shared_replies)
    if kind == "ngram-tree":
        from kakeya_lab.tree_proposers import NgramTreeProposer

        return NgramTreeProposer([int(n) for n in arg.split(",")] if arg else [3, 2, 1])
    if kind == "ngram":
        return NgramProposer([int(n) for n in arg.split(",")] if arg else (3, 2, 1))
    if kind == "suffix":
        from kakeya_lab.suffix import SuffixProposer

        return SuffixProposer(max_depth=int(arg) if arg else 8, shared=shared_replies)
    if kind == "early-exit":
        return EarlyExitProposer(model, config, num_layers=int(arg))
    if kind == "draft":
        name, kernel = draft_model_spec(arg)
        if draft_model is None:
            from kakeya_lab.models import load_model

            draft_model = load_model(
                name,
                dtype=next(model.parameters()).dtype,
                linear=kernel or draft_linear or linear_kernel_of(model),
            )
        elif kernel:
            raise ValueError(
                f"{spec!r} names a kernel for a draft model that is already loaded; "
                "load it with that kernel (load_model(..., linear=...)) and write draft:MODEL"
            )
        net = getattr(draft_model, "model", draft_model)
        return DraftModelProposer(
            net,
            config if draft_window is None else replace(config, window=draft_window),
            tokenizer=getattr(draft_model, "tokenizer", None),
            verifier_tokenizer=tokenizer,
            label=arg,
        )
    # drafter:NAME or drafter-tree:NAME, the only kinds left after check_proposer_spec
    from kakeya_lab.align.drafters import DrafterProposer, DrafterTreeProposer
    from kakeya_lab.align.named import load_named_drafter

    if not registry.entry_of(model).hidden_states:
        raise ValueError(
            f"{spec!r}: named drafters read the verifier's hidden states, which only the "
            "torch backend traces; load the model with backend='torch'"
        )
    drafter = load_named_drafter(arg, model, verifier_sha256)
    if kind == "drafter-tree":
        return DrafterTreeProposer(cast("FeatureDrafter", drafter), label=f"{arg} (tree)")
    if drafter.config.kind == "lora":  # a distilled draft model, with its own cache
        return DraftModelProposer(cast("LoraDrafter", drafter).draft_model(), config, label=arg)
    return DrafterProposer(cast("Drafter", drafter), label=arg)
