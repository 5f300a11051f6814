"""Draft proposers for speculative decoding (docs/design.md "Proposers").

Protocol: ``propose(context, draft_length, sampling, generator=None) -> Draft`` where
``context`` is the session's token history so far (every token the verifier has accepted
or emitted), ``sampling`` a :class:`~kakeya_lab.sampling.SamplingConfig` (greedy drafts
when it is greedy) and ``generator`` the random source to draw from; ``accept(n)`` tells
the proposer how many of its last draft's tokens were accepted, so it can roll back its
own state. A proposer keeps whatever state it wants but must resynchronise from
``context`` alone: if its own history is not a prefix of ``context`` it starts over.
A proposer that conditions on the verifier's hidden states may also define
``bind(verifier)``; the decoder calls it before the first draft (see
:class:`kakeya_lab.align.drafters.DrafterProposer`).

* :class:`NgramProposer` — prompt lookup over the history, no model.
* :class:`DraftModelProposer` — a smaller model sharing the tokenizer, with its own
  sink-window cache (drafts greedily or by sampling; rejected drafts are rolled back).
* :class:`EarlyExitProposer` — self-speculation: the verifier's first ``L`` layers with
  its final norm and lm_head, as a draft model sharing the verifier's weights.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PreTrainedModel

from kakeya_lab import inputs
from kakeya_lab.backend import backend_name_of
from kakeya_lab.cache import SinkWindowConfig
from kakeya_lab.inputs import InputTypeError
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.verifier import Verifier


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
    (largest n first) and propose the tokens that followed it."""

    name = "ngram"

    def __init__(self, ngram_sizes: Sequence[int] = (3, 2, 1), max_lookback: int | None = None):
        if isinstance(ngram_sizes, (str, bytes)) or not hasattr(ngram_sizes, "__iter__"):
            raise InputTypeError(f"ngram_sizes must be a sequence of integers >= 1, got {ngram_sizes!r}")
        sizes = sorted({inputs.count(n, "an n-gram size", minimum=1) for n in ngram_sizes}, reverse=True)
        if not sizes:
            raise ValueError("ngram_sizes is empty: give at least one n-gram size, e.g. (3, 2, 1)")
        self.ngram_sizes = sizes
        if max_lookback is not None:
            max_lookback = inputs.count(max_lookback, "max_lookback", minimum=1)
        self.max_lookback = max_lookback

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        t0 = time.perf_counter()
        ctx = list(context)
        if self.max_lookback is not None:
            ctx = ctx[-self.max_lookback :]
        tokens: list[int] = []
        if draft_length >= 1:
            t = torch.tensor(ctx, dtype=torch.long)
            for n in self.ngram_sizes:
                if len(ctx) <= n:
                    continue
                windows = t.unfold(0, n, 1)[:-1]  # every earlier n-gram (not the suffix itself)
                hits = torch.nonzero((windows == t[-n:]).all(dim=1)).flatten()
                if hits.numel():
                    start = int(hits[-1]) + n
                    tokens = ctx[start : start + draft_length]
                    if tokens:
                        break
        return Draft(tokens=tokens, probs=None, seconds=time.perf_counter() - t0)

    def accept(self, n: int) -> None:
        return None

    def describe(self) -> dict:
        return {"name": self.name, "ngram_sizes": self.ngram_sizes, "max_lookback": self.max_lookback}


class DraftModelProposer:
    """A draft model with its own sink-window cache.

    Drafts ``draft_length`` tokens autoregressively (greedy when ``sampling`` is greedy,
    else sampled from the same filtered distribution the verifier samples from). After ``accept(n)`` its
    cache keeps the accepted drafts and drops the rest.
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
    ):
        check_same_tokenizer(tokenizer, verifier_tokenizer)
        self.model = model
        self.config = config
        self.label = label or getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
        self.verifier = Verifier(model, config)
        self._next_logits: torch.Tensor | None = None
        self._rows: list[torch.Tensor] = []

    def _sync(self, context: list[int]) -> None:
        """Bring the draft cache to exactly ``context`` (all committed), with next logits."""
        v = self.verifier
        v.rollback()
        history = v.history_token_ids
        if len(history) > len(context) or history != context[: len(history)]:
            self.verifier = v = Verifier(self.model, self.config)
            history, self._next_logits = [], None
        new = context[len(history) :]
        if new:
            self._next_logits = v.append(new)
        if self._next_logits is None:
            raise ValueError("a draft needs a non-empty context")

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        t0 = time.perf_counter()
        sampling = sampling if sampling is not None else SamplingConfig()
        self._sync(list(context))
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        logits = self._next_logits
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
        return {"name": self.name, "model": self.label, "cache": self.config.to_dict()}


def early_exit_model(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM made of ``model``'s embedding, first ``num_layers`` layers, final norm
    and lm_head — sharing the parameters (no copy)."""
    total = model.config.num_hidden_layers
    num_layers = inputs.count(num_layers, "num_layers", minimum=1, maximum=total - 1,
                              hint=f"early exit keeps fewer than the model's {total} layers")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    with torch.device("meta"):
        draft = type(model)(cfg)
    base, sub = model.base_model, draft.base_model
    sub.embed_tokens = base.embed_tokens
    sub.layers = nn.ModuleList(list(base.layers[:num_layers]))
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
        if backend_name_of(model) == "mlx":
            from kakeya_lab.mlx_backend import mlx_early_exit_model

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
) -> Proposer | None:
    """Build a proposer from a short spec (CLI, notebooks, sweep files).

    ``none`` → ``None`` (plain decoding); ``ngram`` or ``ngram:3,2,1``;
    ``early-exit:LAYERS``; ``draft:MODEL`` (a registry name or local folder, loaded with
    :func:`~kakeya_lab.models.load_model` unless ``draft_model`` — an already loaded model,
    i.e. what ``load_model`` returns or a bare ``PreTrainedModel`` — is given; its tokenizer
    must equal ``tokenizer``).
    """
    usage = "use none, ngram[:SIZES], early-exit:LAYERS or draft:MODEL"
    if spec is not None and not isinstance(spec, str):
        raise InputTypeError(f"proposer spec must be a string or None, got {type(spec).__name__} ({usage})")
    if spec in (None, "", "none"):
        return None
    kind, _, arg = spec.partition(":")
    if kind == "ngram":
        try:
            sizes = [int(n) for n in arg.split(",")] if arg else (3, 2, 1)
        except ValueError:
            raise ValueError(f"bad n-gram sizes in {spec!r}: write them like ngram:3,2,1") from None
        return NgramProposer(sizes)
    if kind == "early-exit" and arg.isdigit():
        return EarlyExitProposer(model, config, num_layers=int(arg))
    if kind == "draft" and arg:
        if draft_model is None:
            from kakeya_lab.models import load_model

            draft_model = load_model(arg, dtype=next(model.parameters()).dtype)
        net = getattr(draft_model, "model", draft_model)
        return DraftModelProposer(
            net, config, tokenizer=getattr(draft_model, "tokenizer", None),
            verifier_tokenizer=tokenizer, label=arg,
        )
    raise ValueError(f"unknown proposer {spec!r}: {usage}")
