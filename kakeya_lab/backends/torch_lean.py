"""A draft model's forward of a few tokens, written out: :class:`LeanForward`.

A draft model spends its time in one-token forwards. On a laptop CPU, once its weights are
quantised (:mod:`kakeya_lab.linear`), a small model's token costs more in the Python around
the products than in the products: transformers' forward calls about twenty modules per
layer, converts dtypes at each linear layer and builds the mask and rotary tables every time.
:class:`LeanForward` computes the same forward of the same weights as one straight sequence
of tensor operations over the model's own :class:`~kakeya_lab.backends.torch_cache.SinkWindowCache`: the
q, k and v projections fused into one product and the gate and up projections into another
(copies of the weights packed with the model's kernel), the cache's own key layout as the
attention mask (so eviction, rolling positions and pending blocks mean what they mean for
transformers' forward), and transformers' rotary module for the angles.

It is for draft models only: its rounding can differ from transformers' forward (one fused
RMSNorm computed in the model's dtype; on a float32 model the logits agree to float
rounding, as the tests check against the dense oracle), which can change which drafts a
draft model proposes, never what speculative decoding emits. With a quantised kernel the
fused projections hold only their packed copies; with a full-precision kernel they are the
model's own layers, so a lean forward adds no full-precision weights. The
torch backend builds it for a verifier created with ``lean=True`` (a draft model's cache;
:class:`~kakeya_lab.backends.torch_backend.TorchBackend`); a verifier whose output is
delivered always runs transformers' forward. Supported: Llama, Qwen2 and Qwen3 layer stacks
with plain (or this package's) linear layers and no sliding-window layers
(:meth:`LeanForward.supports`); anything else keeps transformers' forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kakeya_lab.backends.torch_cache import SinkWindowCache
from kakeya_lab.linear import FEW_ROWS, QuantizedLinear, linear_kernel_of, set_linear_kernel

ARCHITECTURES = ("llama", "qwen2", "qwen3")
MAX_TOKENS = FEW_ROWS  # longer blocks (prefills) keep transformers' forward


Projection = nn.Linear | tuple[nn.Linear, ...]


def _fused(layers: Sequence[nn.Linear], kernel: str) -> Projection:
    """``layers`` side by side (their outputs concatenated). With a quantised kernel that can
    tile their stacked weights: one layer holding only the packed copy of the stack (the
    full-precision stack is dropped once packed, so it costs the packed bytes alone, and
    only :func:`_product` may call it); otherwise the layers themselves (no copy)."""
    weight = torch.cat([layer.weight.detach() for layer in layers])
    with torch.device("meta"):  # no throw-away initialisation
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if any(layer.bias is not None for layer in layers):
        biases = [
            layer.bias.detach() if layer.bias is not None else weight.new_zeros(layer.out_features)
            for layer in layers
        ]
        fused.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    set_linear_kernel(fused, kernel)
    if not isinstance(fused, QuantizedLinear):
        return tuple(layers)
    fused.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
    return fused


def _product(layer: Projection, rows: torch.Tensor) -> torch.Tensor:
    """``layer(rows)`` for 2-D ``rows`` of at most :data:`MAX_TOKENS`, in ``rows``' dtype;
    a quantised layer's kernel is called directly (rows rounded to bfloat16 once)."""
    if isinstance(layer, tuple):
        return torch.cat([_product(part, rows) for part in layer], dim=-1)
    if isinstance(layer, QuantizedLinear):
        out = layer.product(rows.to(torch.bfloat16)).to(rows.dtype)
        return out if layer.bias is None else out + layer.bias
    return layer(rows)


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """RMSNorm of ``x`` in one fused operation (transformers' module takes eight)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` ``[..., head_dim]`` (transformers' ``rotate_half`` form)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LeanForward:
    """``model``'s forward of up to :data:`MAX_TOKENS` tokens over its sink-window cache,
    written out (module docstring). Build it once per model and after any change of its
    linear kernel (it packs fused copies of the attention and MLP input projections with
    the model's kernel); it holds no state between calls, so one serves every cache of that
    model."""

    def __init__(self, model: PreTrainedModel):
        problem = self.unsupported(model)
        if problem:
            raise ValueError(f"LeanForward does not support this model: {problem}")
        kernel = linear_kernel_of(model)
        cfg = model.config
        base: Any = model.base_model  # nn.Module attributes type as Tensor | Module
        self.model = model
        self.kernel = kernel
        self.forwards = 0  # calls so far (how a caller can tell the lean path ran)
        self.embed = base.embed_tokens
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head: Any = model.lm_head
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.layers: list[tuple[Any, ...]] = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    attn,
                    layer.input_layernorm,
                    _fused([attn.q_proj, attn.k_proj, attn.v_proj], kernel),
                    getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None),
                    attn.o_proj,
                    layer.post_attention_layernorm,
                    _fused([mlp.gate_proj, mlp.up_proj], kernel),
                    mlp.down_proj,
                )
            )

    @staticmethod
    def unsupported(model: nn.Module) -> str:
        """Why :class:`LeanForward` cannot run ``model`` ("" when it can)."""
        cfg = getattr(model, "config", None)
        model_type = getattr(cfg, "model_type", None)
        if model_type not in ARCHITECTURES:
            return f"architecture {model_type!r} (supported: {', '.join(ARCHITECTURES)})"
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            return "sliding-window layers"
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            return f"activation {act!r}"
        base: Any = getattr(model, "base_model", None)
        for layer in getattr(base, "layers", ()):
            attn, mlp = layer.self_attn, layer.mlp
            for name, proj in (
                ("q_proj", attn.q_proj),
                ("k_proj", attn.k_proj),
                ("v_proj", attn.v_proj),
                ("o_proj", attn.o_proj),
                ("gate_proj", mlp.gate_proj),
                ("up_proj", mlp.up_proj),
                ("down_proj", mlp.down_proj),
            ):
                if not isinstance(proj, nn.Linear):
                    return f"{name} is a {type(proj).__name__}, not a linear layer"
        return ""

    @classmethod
    def of(cls, model: PreTrainedModel) -> LeanForward:
        """The lean forward of ``model`` for its current linear kernel, built once and
        shared by every draft cache of that model (packing a 0.5B model's fused projections
        takes seconds and their packed bytes would otherwise be held once per proposer)."""
        # kept in the model's __dict__: not a submodule (no state dict entries), and it goes
        # with the model (a weak-keyed table would not: the forward refers to the model)
        lean = model.__dict__.get("_lean_forward")
        if lean is None or lean.kernel != linear_kernel_of(model):
            lean = model.__dict__["_lean_forward"] = cls(model)
        return lean

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        """Whether :class:`LeanForward` can run ``model``."""
        return not cls.unsupported(model)

    @torch.inference_mode()
    def __call__(
        self, cache: SinkWindowCache, token_ids: Sequence[int], *, all_rows: bool
    ) -> torch.Tensor:
        """Append ``token_ids`` (at most :data:`MAX_TOKENS`) to ``cache`` as a provisional
        block, as transformers' forward would; the logits of every row (``all_rows``) or the
        last, float32 ``[rows, vocab]``."""
        n = len(token_ids)
        if not 1 <= n <= MAX_TOKENS:
            raise ValueError(f"LeanForward takes 1 to {MAX_TOKENS} tokens, got {n}")
        self.forwards += 1
        start = cache.next_position
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.embed.weight.device)
        x = self.embed(ids)[None]  # [1, n, hidden]
        positions = torch.arange(start, start + n, device=ids.device)[None]
        cos, sin = self.rotary(x, positions)  # [1, n, head_dim], broadcast over heads
        mask = cache.get_mask_sizes(n, 0)[1].mask  # what transformers' forward is given
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        for i, (attn, norm1, qkv, q_norm, k_norm, o_proj, norm2, gate_up, down) in enumerate(
            self.layers
        ):
            qkv_rows = _product(qkv, _rms(x, norm1)[0]).view(n, h + 2 * kv, d)
            if q_norm is None:  # q and k rotated in one go
                qk = _rotate(qkv_rows[:, : h + kv].transpose(0, 1), cos, sin)
                q, k = qk[None, :h], qk[None, h:]
            else:  # Qwen3: each head's q and k normalised first
                q = _rotate(q_norm(qkv_rows[:, :h]).transpose(0, 1), cos, sin)[None]
                k = _rotate(k_norm(qkv_rows[:, h : h + kv]).transpose(0, 1), cos, sin)[None]
            v = qkv_rows[:, h + kv :].transpose(0, 1)[None]
            keys, values = cache.update(k, v, i)
            # transformers' own SDPA call: the same kernel choice (e.g. a one-token query's
            # heads packed onto the key heads) as its forward
            out = sdpa_attention_forward(attn, q, keys, values, mask, scaling=attn.scaling)[0]
            x = x + _product(o_proj, out.reshape(n, h * d))[None]
            gate, up = _product(gate_up, _rms(x, norm2)[0]).chunk(2, dim=-1)
            x = x + _product(down, F.silu(gate) * up)[None]
        rows = _rms(x, self.norm)[0] if all_rows else _rms(x[:, -1:], self.norm)[0]
        return _product(self.lm_head, rows).float()
