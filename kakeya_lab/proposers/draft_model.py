"""A smaller model drafting for the verifier (``draft:MODEL[:KERNEL]``), with its own
sink-window cache; the torch backend runs its steps through the lean forward where it can."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.linear import linear_kernel_of
from kakeya_lab.proposers.base import Draft, check_same_tokenizer
from kakeya_lab.proposers.builtin import draft_model_spec
from kakeya_lab.proposers.registry import ProposerRequest
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.verifier import Verifier

if TYPE_CHECKING:
    from kakeya_lab.backends.torch_lean import LeanForward


class DraftModelProposer:
    """A draft model with its own sink-window cache.

    Drafts ``draft_length`` tokens autoregressively (greedy when ``sampling`` is greedy,
    else sampled from the same filtered distribution the verifier samples from). After ``accept(n)`` its
    cache keeps the accepted drafts and drops the rest. With ``lean`` (the default) a model
    :class:`~kakeya_lab.backends.torch_lean.LeanForward` supports runs its one-token steps through it
    (cheaper on CPU, rounded differently; ``describe()["forward"]`` says which ran).

    With ``copy_prompt`` (for a draft model that is the verifier's own weights, e.g. its
    quantised copy: the same layer shapes and rotary embedding) a stretch of at least
    :data:`COPY_AT_LEAST` new tokens the verifier already read (a user turn) is taken into
    the draft cache as the verifier's keys and values (``Verifier.append_copied``) rather
    than through a forward of its own, which on a CPU costs about what the verifier's
    prefill does; only the last token of the context is forwarded (its logits start the
    draft). The decoder gives the verifier (``bind``); without it, or where the verifier
    no longer holds those entries, the draft appends them itself. The verifier checks every
    draft, so the stream is the same either way; ``copied_tokens`` counts the tokens taken.
    """

    name = "draft_model"
    COPY_AT_LEAST = 4  # shorter stretches (a step's accepted tail) the draft forwards itself

    def __init__(
        self,
        model: PreTrainedModel,
        config: SinkWindowConfig,
        *,
        tokenizer=None,
        verifier_tokenizer=None,
        label: str | None = None,
        lean: bool = True,
        copy_prompt: bool = False,
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
        self.copy_prompt = copy_prompt
        self.copied_tokens = 0
        self._source: weakref.ref[Verifier] | None = None  # the verifier (bind), weakly
        self.verifier = self._new_cache()
        self._next_logits: torch.Tensor | None = None
        self._rows: list[torch.Tensor] = []

    def bind(self, verifier: Verifier) -> None:
        """The verifier this proposer drafts for (the decoder calls it): with
        ``copy_prompt``, where a prompt's keys and values are copied from."""
        self._source = weakref.ref(verifier) if self.copy_prompt else None

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
        source = self._source() if self._source is not None else None
        if (
            source is not None
            and len(new) > self.COPY_AT_LEAST
            and v.append_copied(source, new[:-1])
        ):
            self.copied_tokens += len(new) - 1
            new = new[-1:]
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
            "prompt": "copied from the verifier" if self.copy_prompt else "forwarded",
        }


def draft_model_choice(argument: str, request: ProposerRequest) -> tuple[str, str]:
    """The model and linear kernel a ``draft:MODEL[:KERNEL]`` argument loads: ``KERNEL``,
    else the request's ``draft_linear``, else the verifier's kernel."""
    name, kernel = draft_model_spec(argument)
    return name, kernel or request.draft_linear or linear_kernel_of(request.model)


def load_draft_model(argument: str, request: ProposerRequest):
    """Load the draft model of ``draft:MODEL[:KERNEL]`` (:func:`draft_model_choice`) with
    :func:`~kakeya_lab.models.load_model`, in the verifier's dtype: what :func:`build`
    loads when the request carries none, and what a server loads once to share."""
    from kakeya_lab.models import load_model

    name, kernel = draft_model_choice(argument, request)
    return load_model(name, dtype=next(request.model.parameters()).dtype, linear=kernel)


def build(argument: str, request: ProposerRequest) -> DraftModelProposer:
    """``draft:MODEL[:KERNEL]``: ``MODEL`` (a registry name or local folder) loaded with
    :func:`load_draft_model` unless the request carries ``draft_model`` (an already loaded
    model: what ``load_model`` returns or a bare ``PreTrainedModel``, e.g. one a server
    shares across its sessions), in the verifier's dtype and with ``KERNEL`` as its linear
    kernel, else the request's ``draft_linear``, else the verifier's (``int8``/``int4``:
    quantised weights, cheaper steps on CPU, :mod:`kakeya_lab.linear`). Its own sink-window
    cache keeps the config's sinks and positions and ``draft_window`` recent entries
    (default: the config's window); its tokenizer must equal the verifier's. A draft model
    loaded from the verifier's own weights (the same ``weight_sha256`` as the request's
    ``verifier_sha256``: a quantised copy) copies each prompt's keys and values from the
    verifier (``copy_prompt``) instead of reading the prompt again."""
    from kakeya_lab.models.load import LoadedModel

    _, kernel = draft_model_spec(argument)
    draft_model = request.draft_model
    if draft_model is None:
        draft_model = load_draft_model(argument, request)
    elif kernel:
        network = draft_model.model if isinstance(draft_model, LoadedModel) else draft_model
        if linear_kernel_of(network) != kernel:
            raise ValueError(
                f"draft:{argument} names the {kernel} kernel, but the draft model already "
                f"loaded runs {linear_kernel_of(network)}: load it with that kernel "
                "(load_model(..., linear=...)) or write draft:MODEL"
            )
    # what load_model returns carries its tokenizer; a bare model is the network itself (a
    # PreTrainedModel's own ``.model`` is its base without the lm_head)
    loaded = isinstance(draft_model, LoadedModel)
    config = request.config
    own_weights = (
        loaded
        and request.verifier_sha256 is not None
        and draft_model.description.weight_sha256 == request.verifier_sha256
    )
    return DraftModelProposer(
        draft_model.model if loaded else draft_model,
        config if request.draft_window is None else replace(config, window=request.draft_window),
        tokenizer=draft_model.tokenizer if loaded else None,
        verifier_tokenizer=request.tokenizer,
        label=argument,
        copy_prompt=own_weights,
    )
