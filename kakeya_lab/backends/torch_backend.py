"""The torch backend: a transformers causal LM over a
:class:`~kakeya_lab.backends.torch_cache.SinkWindowCache` (registered as ``"torch"``).

Options: ``block_padding`` (a block scored at a cheaper larger size, see
:func:`kakeya_lab.cost_model.block_padding`) and ``lean``: short chain blocks run through
:class:`~kakeya_lab.backends.torch_lean.LeanForward` when it supports the model (the same
logits as transformers' forward to float rounding, checked against the dense oracle);
``None`` (the default) does so unless the model runs a quantised kernel (whose lean forward
packs fused copies of the projections), ``True`` also then (draft models), ``False`` never.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.seam import CacheBackend, Forward
from kakeya_lab.backends.torch_attention import enable_sink_window_attention
from kakeya_lab.backends.torch_cache import SinkWindowCache, cache_kwarg
from kakeya_lab.backends.torch_lean import MAX_TOKENS, LeanForward
from kakeya_lab.linear import QUANTISED, linear_kernel_of
from kakeya_lab.models.dims import model_dims
from kakeya_lab.tree import DraftTree


def make_backend(
    model: PreTrainedModel,
    config: SinkWindowConfig,
    *,
    block_padding: Mapping[int, int] | None = None,
    lean: bool | None = None,
) -> TorchBackend:
    """The registry's constructor: a :class:`TorchBackend`."""
    return TorchBackend(model, config, block_padding=block_padding, lean=lean)


def vocab_size_of(model: Any) -> int:
    """The rows of the model's input embedding."""
    # torch types any submodule attribute as ``Tensor | Module``; this one is an int.
    return cast(int, model.get_input_embeddings().num_embeddings)


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys plus values one cached token takes over all layers (weights' dtype)."""
    dtype_bytes = next(model.parameters()).element_size()
    return model_dims(model).kv_bytes_per_token(dtype_bytes)


def check_tree_support(model: Any) -> None:
    """Draft trees run on every torch model (positions by depth go in as position ids)."""


def load_folder(folder: Path, dtype: str = "float32") -> PreTrainedModel:
    """The transformers model in ``folder`` (no network, no remote code) in ``dtype``, in
    eval mode with the sink-window attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=getattr(torch, dtype), use_safetensors=True, local_files_only=True
    )
    return enable_sink_window_attention(model.eval())


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output feeds the lm_head (the final norm of the decoder stack)."""
    norm = getattr(model.base_model, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__} has no final norm at model.base_model.norm")
    return norm


def wants_lean(model: PreTrainedModel, lean: bool | None) -> bool:
    """Whether a backend of ``model`` runs short blocks through its
    :class:`~kakeya_lab.backends.torch_lean.LeanForward` (module docstring: ``lean``)."""
    if lean is False or not LeanForward.supports(model):
        return False
    return lean is True or linear_kernel_of(model) not in QUANTISED


class TorchBackend(CacheBackend):
    """A transformers causal LM over a :class:`SinkWindowCache` (``auto_commit=False``).
    Chain blocks and draft trees of up to :data:`~kakeya_lab.backends.torch_lean.MAX_TOKENS`
    tokens that need no hidden states run through the model's
    :class:`~kakeya_lab.backends.torch_lean.LeanForward` when :func:`wants_lean`
    (``lean_forward``; None otherwise; ``lean_steps`` counts the forwards it ran);
    hidden-state traces, padded blocks and longer chunks or trees run transformers'
    forward, the reference."""

    name = "torch"
    hidden_states = True

    def __init__(
        self,
        model: PreTrainedModel,
        config: SinkWindowConfig,
        *,
        block_padding: Mapping[int, int] | None = None,
        lean: bool | None = None,
    ):
        enable_sink_window_attention(model)
        self.model = model
        self.config = config
        self.vocab_size = vocab_size_of(model)
        self.device = next(model.parameters()).device
        self.cache = SinkWindowCache(model, config, auto_commit=False)
        self.block_padding = dict(block_padding or {})
        self.lean = lean
        self.lean_forward = self._lean_forward()
        self.lean_steps = 0

    def _lean_forward(self) -> LeanForward | None:
        return LeanForward.of(self.model) if wants_lean(self.model, self.lean) else None

    def forward(
        self,
        token_ids: Sequence[int],
        *,
        all_rows: bool,
        hidden: bool = False,
        tree: DraftTree | None = None,
    ) -> Forward:
        ids = list(token_ids)
        start = self.cache.next_position
        n = len(ids)
        # a chain block scored at a cheaper larger size: the padding (the last token again)
        # comes after every real row, so no real row sees it, and is dropped afterwards
        pad = self.block_padding.get(n, n) - n if all_rows and tree is None else 0
        lean = self.lean_forward
        if lean is not None and not lean.current():  # the kernel changed: decide, pack again
            lean = self.lean_forward = self._lean_forward()
        if lean is not None and not hidden and not pad and n <= MAX_TOKENS:
            try:
                with self.cache.tree_forward(tree) if tree is not None else nullcontext():
                    logits = lean(self.cache, ids, all_rows=all_rows)
                self.lean_steps += 1
                return Forward(logits, None)
            except BaseException:
                self.cache.crop(start)  # drop this forward's partial block only
                raise
        input_ids = torch.tensor([ids + ids[-1:] * pad], dtype=torch.long, device=self.device)
        captured: list[torch.Tensor] = []
        hook = None
        if hidden:
            hook = final_norm(self.model).register_forward_hook(
                lambda _m, _i, out: captured.append(out[0].detach().float())
            )
        shape = self.cache.tree_forward(tree) if tree is not None else nullcontext(None)
        try:
            with torch.inference_mode(), shape as tree_positions:
                if tree_positions is None:
                    positions = torch.arange(start, start + n + pad, device=self.device)[None]
                else:
                    positions = tree_positions[None]
                out = self.model(
                    input_ids=input_ids,
                    position_ids=positions,
                    **cache_kwarg(self.model, self.cache),
                    use_cache=True,
                    logits_to_keep=0 if all_rows else 1,
                )
            if pad:
                self.cache.crop(start + n)
        except BaseException:
            self.cache.crop(start)  # drop this forward's partial block only
            raise
        finally:
            if hook is not None:
                hook.remove()
        hidden_rows = captured[-1][:n] if captured else None
        return Forward(out.logits[0, : n if all_rows else 1].float(), hidden_rows)
