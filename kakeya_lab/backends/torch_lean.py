"""A forward of a few tokens, written out: :class:`LeanForward`.

A one-token step (plain decoding, a draft model's step) or a short verification block is
dominated by reading the weights; on a CPU the Python around the products adds a real
share on top: transformers' forward calls about twenty modules per layer, converts dtypes at
each linear layer and builds the mask and rotary tables every time. :class:`LeanForward`
computes the same forward of the same weights as one straight sequence of tensor operations
over the model's own :class:`~kakeya_lab.backends.torch_cache.SinkWindowCache`: the cache's
own key layout as the attention mask (so eviction, rolling positions and pending blocks mean
what they mean for transformers' forward), transformers' rotary module for the angles, the
RMSNorms in one fused operation each (rounded as transformers' module rounds them), and
PyTorch's SDPA with a one-token query's heads packed onto their key heads (a float32
block's heads grouped onto them with ``enable_gqa``, no repeated keys; other dtypes repeat
the keys, as transformers does, PyTorch's bfloat16 CPU kernel being slow with grouping).
With float32 rows on a CPU where the compiled kernels build (:mod:`kakeya_lab.native.step`),
the RMSNorms, the rotary embedding and the attention each run as one compiled pass
instead (``LeanForward(model, compiled=False)`` keeps PyTorch's operations):
in a one-token step the dispatch of the small operations between the products costs more
than their arithmetic. Further, each layer can run as one compiled call
(:meth:`LeanForward.compiled_layer`, ``native/layer.cpp``): on ``split`` with two threads or
more, for up to 16 rows, its products the compiled few-row product (a one-token step 9%
faster, a batched step of 8 sessions 8%, in an interleaved A/B on this machine kind), and on
``int4-vnni``; the first layer too, once each cache's block is opened for it
(``SinkWindowCache.open_block``).

With a full-precision kernel the q/k/v and the gate/up projections each run as one product
over their weights stacked (:func:`~kakeya_lab.linear.stack_rows`: the weights re-laid once
as consecutive rows of one tensor, the layers' own parameters becoming views of it), on the
kernel the layers run; so a lean forward adds no weights and its logits are transformers' to
float rounding: the tests hold it to the dense oracle at 1e-4 (float32), as transformers'
forward is held. With a quantised kernel the q/k/v
and the gate/up projections are fused into one packed copy each (the draft models' case),
which the torch backend only builds when asked (``lean=True``). The backend runs every
verifier's short chain blocks and draft trees through it by default
(:class:`~kakeya_lab.backends.torch_backend.TorchBackend`; a tree's nodes at their depths'
positions under its ancestor mask, both from the cache's plan); hidden-state traces and
long chunks keep transformers' forward, the reference. Supported: Llama, Qwen2 and Qwen3
layer stacks with plain (or this package's) linear layers and no sliding-window layers
(:meth:`LeanForward.supports`); anything else keeps transformers' forward.

The forward is made of per-layer pieces (:meth:`LeanForward.embed`, :meth:`~LeanForward.rope`,
:meth:`~LeanForward.layer`: :meth:`~LeanForward.qkv`, :meth:`~LeanForward.attend`,
:meth:`~LeanForward.finish_layer`, or one compiled call; :meth:`~LeanForward.logits`) over 2-D
rows, so rows of several caches can share the
projections while each attends over its own cache (:meth:`~LeanForward.attend_all`: with
the compiled operations, every cache's block written and attended in one call a layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from kakeya_lab.backends.torch_attention import LayoutMask
from kakeya_lab.backends.torch_cache import SinkWindowCache
from kakeya_lab.linear import (
    FEW_ROWS,
    QUANTISED,
    Int4VnniLinear,
    QuantizedLinear,
    linear_as,
    linear_kernel_of,
    product_kernel,
    set_linear_kernel,
    stack_rows,
)
from kakeya_lab.native import exact
from kakeya_lab.native import rows as few_rows
from kakeya_lab.native.step import step_kernels

ARCHITECTURES = ("llama", "qwen2", "qwen3")
MAX_TOKENS = FEW_ROWS  # longer blocks (prefills) keep transformers' forward
# rotary types whose frequencies transformers fixes at load (LeanForward.rope computes their
# tables itself); the others (dynamic, longrope) change with the sequence: their module runs
STATIC_ROPE = ("default", "linear", "llama3")
ROPE_BLOCK = 2048  # positions per block of LeanForward.rope's tables
ROPE_BLOCKS_KEPT = 8  # blocks kept (sessions far apart each keep theirs; ~1 MB a block)


@dataclass(frozen=True)
class Stacked:
    """Layers whose weights are consecutive rows of one tensor (:func:`stack_rows`), run as
    one product on their kernel: their outputs side by side."""

    layers: tuple[nn.Linear, ...]
    weight: torch.Tensor
    bias: torch.Tensor | None


Projection = nn.Linear | Stacked | tuple[nn.Linear, ...]


@dataclass
class CompiledLayer:
    """A decoder layer's operands for one compiled call (``native/layer.cpp``): ``kind``
    ``"float"`` (``float_layer``: its four float32 weights, q/k/v and gate/up stacked, on the
    few-row product, or their exact integer forms (:meth:`exact_operands`); the blocks of
    any caches) or ``"int4"`` (``int4_layer``: its packed ``int4-vnni`` weights; one
    cache)."""

    kind: str
    operands: list[torch.Tensor]
    # (the weights' versions, their exact forms' (codes, so) in order or None: not all exact)
    _exact: tuple[tuple[int, ...], list[torch.Tensor] | None] | None = None

    def exact_operands(self) -> list[torch.Tensor] | None:
        """The four float32 weights' exact integer forms as ``float_layer`` takes them in
        their place (codes and so of each, in order), or None when any has none; kept here
        while the weights are not changed in place, so a step asks for them once."""
        versions = tuple(exact.version(w) for w in self.operands)
        if self._exact is None or self._exact[0] != versions:
            forms = [exact.packed(w) for w in self.operands]
            flat = [t for f in forms if f is not None for t in f]
            self._exact = (versions, flat if len(flat) == 2 * len(forms) else None)
        return self._exact[1]


def _fused(layers: Sequence[nn.Linear], kernel: str) -> Projection:
    """``layers`` side by side (their outputs concatenated). With a full-precision kernel:
    their weights stacked, the layers' own parameters becoming views of the stack
    (:func:`stack_rows`: no bytes added, one product instead of several). With a quantised
    kernel that can tile their stacked weights: one layer holding only the packed copy of
    the stack (the full-precision stack is dropped once packed, so it costs the packed bytes
    alone, and only :func:`_product` may call it); otherwise the layers themselves."""
    if kernel not in QUANTISED:
        return Stacked(tuple(layers), *stack_rows(layers))
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
    a quantised layer's kernel is called directly (rows cast to its row dtype once)."""
    if isinstance(layer, Stacked):
        return linear_as(layer.layers[0], layer.weight, layer.bias, rows)
    if isinstance(layer, tuple):
        return torch.cat([_product(part, rows) for part in layer], dim=-1)
    if isinstance(layer, QuantizedLinear):
        out = layer.product(rows.to(layer.row_dtype)).to(rows.dtype)
        return out if layer.bias is None else out + layer.bias
    return layer(rows)


def _hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs forward hooks (its own or every module's)."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn.modules.module._global_forward_hooks
        or nn.modules.module._global_forward_pre_hooks
    )


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """RMSNorm of ``x`` in one fused operation (transformers' module takes eight), rounded
    as transformers' module rounds: normalised in float32, then cast to ``x``'s dtype and
    scaled by the weight in it."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    normed = F.rms_norm(x.float(), norm.weight.shape, None, norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


@dataclass(frozen=True)
class LeanLayer:
    """One decoder layer's pieces as :class:`LeanForward` runs them: its two RMSNorms, the
    fused q/k/v and gate/up projections (:func:`_fused`), Qwen3's per-head q and k norms
    (None elsewhere), and the output and down projections (the model's own layers)."""

    norm1: Any
    qkv: Projection
    q_norm: Any
    k_norm: Any
    o_proj: nn.Linear
    norm2: Any
    gate_up: Projection
    down: nn.Linear


def step_mask(layout: LayoutMask, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A lean step's mask of ``n`` rows from its cache's ``layout`` (what transformers'
    forward is given), as :meth:`LeanForward.attend` (``[1, 1, n, columns]``) and as the
    compiled operations (``[n, columns]``, contiguous) take it; both None for a one-token
    step that sees every column (no mask: the cheaper path, and no tensor made)."""
    if n == 1 and layout.sees_all:
        return None, None
    mask = layout.mask
    return mask, mask.reshape(n, -1).contiguous()


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

    def __init__(self, model: PreTrainedModel, *, compiled: bool = True):
        problem = self.unsupported(model)
        if problem:
            raise ValueError(f"LeanForward does not support this model: {problem}")
        kernel = linear_kernel_of(model)
        cfg = model.config
        base: Any = model.base_model  # nn.Module attributes type as Tensor | Module
        self.model = model
        self.kernel = kernel
        self.forwards = 0  # calls so far (how a caller can tell the lean path ran)
        self.compiled_layer_calls = 0  # layers run as one compiled call (compiled_layer)
        self.attend_many_calls = 0  # compiled several-cache attention calls (attend_all)
        self.embed_tokens = base.embed_tokens
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head: Any = model.lm_head
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = float(base.layers[0].self_attn.scaling)
        # the compiled step operations (native/step.py), where they take this model's rows
        weight = self.embed_tokens.weight
        self.native = (
            step_kernels(weight.dtype, weight.device, cfg.hidden_size, self.head_dim)
            if compiled
            else None
        )
        # the layer whose class tells whether the model's kernel changed since (current())
        self._probe = (base.layers[0].self_attn.o_proj, type(base.layers[0].self_attn.o_proj))
        self.layers = [
            LeanLayer(
                norm1=layer.input_layernorm,
                qkv=_fused(
                    [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                    kernel,
                ),
                q_norm=getattr(layer.self_attn, "q_norm", None),
                k_norm=getattr(layer.self_attn, "k_norm", None),
                o_proj=layer.self_attn.o_proj,
                norm2=layer.post_attention_layernorm,
                gate_up=_fused([layer.mlp.gate_proj, layer.mlp.up_proj], kernel),
                down=layer.mlp.down_proj,
            )
            for layer in base.layers
        ]
        # each layer's operands where the whole layer can run as one compiled call
        self.compiled_layers = [self._compiled_operands(layer) for layer in self.layers]
        # rope's float32 tables (cos, sin) by (block of ROPE_BLOCK positions, device)
        self._rope_blocks: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _compiled_operands(self, layer: LeanLayer) -> CompiledLayer | None:
        """``layer``'s operands for one compiled call (float32 rows through the compiled step
        operations, no per-head norms, no biases, one epsilon): its packed weights on
        ``int4-vnni``; on a full-precision kernel its float32 weights, q/k/v and gate/up
        stacked, every input width a multiple of 16; else None."""
        projections = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        if (
            self.native is None
            or layer.q_norm is not None
            or layer.norm1.variance_epsilon != layer.norm2.variance_epsilon
            or any(getattr(p, "bias", None) is not None for p in projections)
        ):
            return None
        if self.kernel == "int4-vnni":
            if not all(isinstance(p, Int4VnniLinear) for p in projections):
                return None
            return CompiledLayer(
                "int4", [t for p in projections for t in cast(Int4VnniLinear, p)._packed]
            )
        if self.kernel in QUANTISED or not all(
            isinstance(p, Stacked | nn.Linear) for p in projections
        ):
            return None
        weights = [cast(Stacked | nn.Linear, p).weight for p in projections]
        if any(
            w.dtype != torch.float32 or not w.is_contiguous() or w.shape[1] % 16 for w in weights
        ):
            return None
        return CompiledLayer("float", weights)

    def compiled_for(self, i: int, x: torch.Tensor, caches: int) -> bool:
        """Whether layer ``i`` of the rows ``x`` of ``caches`` caches runs as one compiled
        call (:meth:`compiled_layer`): an ``int4-vnni`` layer for one cache; a
        full-precision layer where its kernel runs ``split`` or ``exact`` for this many rows
        (at most the few-row product's 16, two threads or more: then the compiled layer's
        products are that kernel's: the few-row product, or the weights' exact integer form's
        where they have one, the same bits) and its output and down
        projections, which the operations one by one call as modules, have no forward hooks
        (a hook sees what it would see without the compiled layer) and still hold the weights
        it was built with."""
        layer = self.compiled_layers[i]
        if layer is None:
            return False
        if layer.kind == "int4":
            return caches == 1
        o_proj, down = self.layers[i].o_proj, self.layers[i].down  # the modules it would call
        return (
            x.shape[0] <= few_rows.MAX_ROWS
            and torch.get_num_threads() >= 2
            and product_kernel(o_proj, x) in ("split", "exact")
            and not (_hooked(o_proj) or _hooked(down))
            # their weights are still the ones it holds (not replaced since)
            and o_proj._parameters.get("weight") is layer.operands[1]
            and down._parameters.get("weight") is layer.operands[3]
        )

    def compiled_layer(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        spans: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]],
        bounds: Sequence[int],
        seen: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """Layer ``i``'s output rows of ``x`` in one compiled call (where
        :meth:`compiled_for`): cache ``j``'s rows ``bounds[j]:bounds[j + 1]``, its block
        written to the slots ``spans[j]`` gives (``SinkWindowCache.span_slots``), ``seen[j]``
        its layout as :meth:`attend_all` takes it."""
        compiled, layer = self.compiled_layers[i], self.layers[i]
        assert compiled is not None and self.native is not None
        self.compiled_layer_calls += 1
        common = (x, layer.norm1.weight, layer.norm2.weight, layer.norm1.variance_epsilon)
        if compiled.kind == "int4":
            ((keys, values, start, columns),) = spans
            return self.native.int4_layer(
                *common, compiled.operands, cos, sin, self.heads, self.kv_heads,
                keys, values, start, columns, seen[0], self.scaling,
            )  # fmt: skip
        # split's product, or exact's (the same bits) from the weights' exact integer forms
        operands = compiled.operands
        if product_kernel(layer.o_proj, x) == "exact":
            operands = compiled.exact_operands() or operands
        return self.native.float_layer(
            *common, operands, cos, sin, self.heads, self.kv_heads,
            [s[0] for s in spans], [s[1] for s in spans], list(bounds),
            [s[2] for s in spans], [s[3] for s in spans], list(seen), self.scaling,
        )  # fmt: skip

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
        if lean is None or not lean.current():
            lean = model.__dict__["_lean_forward"] = cls(model)
        return lean

    def current(self) -> bool:
        """Whether this forward still fits the model's kernel (a cheap check; :meth:`of`
        builds a new one otherwise): a quantised one must be the one it packed for; any
        full-precision one (``aten``, ``onednn``, ``split``, ``auto``) runs on the kernel of
        the model's own layers, so a switch among those needs nothing new, as long as the
        layers' weights still are views of the stacks (a parameter replaced since is not)."""
        layer, cls = self._probe
        if self.kernel in QUANTISED:
            return type(layer) is cls
        stacked = self.layers[0].qkv
        return not isinstance(layer, QuantizedLinear) and (
            not isinstance(stacked, Stacked)
            or stacked.layers[0].weight.data_ptr() == stacked.weight.data_ptr()
        )

    @classmethod
    def supports(cls, model: nn.Module) -> bool:
        """Whether :class:`LeanForward` can run ``model``."""
        return not cls.unsupported(model)

    # ------------------------------------------------------------ per-layer pieces
    # A forward is embed -> rope -> for each layer: qkv, attend, finish_layer -> logits. The
    # pieces work on 2-D rows ``[rows, hidden]`` with per-row rotary tables, so a caller can
    # run the projections of several caches' rows at once and attend per cache.

    def embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The input rows ``[rows, hidden]`` of ``token_ids``."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.embed_tokens.weight.device)
        return self.embed_tokens(ids)

    def rope(self, x: torch.Tensor, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables ``(cos, sin)``, ``[rows, head_dim]`` in ``x``'s dtype (contiguous),
        of the rows at ``positions`` (any positions: one cache's run or several):
        transformers' rotary module's. Where its frequencies are fixed they are computed
        with the same float32 products, cosines and sines for whole blocks of
        :data:`ROPE_BLOCK` positions at a time and looked up (a one-token step would
        otherwise spend more on the module's operations than on their arithmetic); the
        :data:`ROPE_BLOCKS_KEPT` blocks made last are kept, so sessions far apart stepping
        in turn each find theirs; rows of several blocks are computed directly."""
        rotary = self.rotary
        if getattr(rotary, "rope_type", None) not in STATIC_ROPE:
            at = torch.tensor(list(positions), device=x.device)
            cos, sin = rotary(x[None], at[None])
            return cos[0].contiguous(), sin[0].contiguous()
        block = min(positions) // ROPE_BLOCK
        if max(positions) // ROPE_BLOCK != block:  # rows of several blocks: computed
            cos, sin = self._rope_rows(torch.tensor(list(positions), device=x.device))
            return cos.to(x.dtype), sin.to(x.dtype)
        key = (block, x.device)
        tables = self._rope_blocks.get(key)
        if tables is None:
            if len(self._rope_blocks) >= ROPE_BLOCKS_KEPT:  # the oldest goes
                self._rope_blocks.pop(next(iter(self._rope_blocks)), None)
            start = block * ROPE_BLOCK
            at = torch.arange(start, start + ROPE_BLOCK, device=x.device)
            tables = self._rope_blocks[key] = self._rope_rows(at)
        cos, sin = tables
        rows = [p - block * ROPE_BLOCK for p in positions]
        if rows == list(range(rows[0], rows[0] + len(rows))):  # one run: a slice
            cos, sin = cos[rows[0] : rows[0] + len(rows)], sin[rows[0] : rows[0] + len(rows)]
        else:
            index = torch.tensor(rows, device=x.device)
            cos, sin = cos[index], sin[index]
        return cos.to(x.dtype), sin.to(x.dtype)

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 rotary tables of ``positions`` as transformers' module computes them
        (before it casts them to the rows' dtype)."""
        rotary = self.rotary
        freqs = positions.to(torch.float32)[:, None] * rotary.inv_freq.to(torch.float32)[None]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        scaling = getattr(rotary, "attention_scaling", 1.0)
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        return cos, sin

    def qkv(
        self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s rotated queries ``[heads, rows, head_dim]`` and keys and values
        ``[kv_heads, rows, head_dim]`` of the rows ``x`` ``[rows, hidden]``."""
        layer = self.layers[i]
        n = x.shape[0]
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        rows = _product(layer.qkv, self._rms(x, layer.norm1)).view(n, h + 2 * kv, d)
        if self.native is not None and layer.q_norm is None and rows.is_contiguous():
            self.native.rotate_(rows, cos, sin, h + kv)  # q and k rotated in place
            rows = rows.transpose(0, 1)
            return rows[:h], rows[h : h + kv], rows[h + kv :]
        rows = rows.transpose(0, 1)
        if layer.q_norm is None:  # q and k rotated in one go
            qk = _rotate(rows[: h + kv], cos, sin)
            q, k = qk[:h], qk[h:]
        else:  # Qwen3: each head's q and k normalised first
            q = _rotate(layer.q_norm(rows[:h]), cos, sin)
            k = _rotate(layer.k_norm(rows[h : h + kv]), cos, sin)
        return q, k, rows[h + kv :]

    def attend(
        self,
        i: int,
        cache: SinkWindowCache,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Store layer ``i``'s keys and values (from :meth:`qkv`, one cache's rows) in
        ``cache`` and return the attention output ``[rows, heads * head_dim]`` over every key
        column of the forward, ``mask`` ``[1, 1, rows, columns]`` being the cache's layout
        (``cache.get_mask_sizes(rows, 0)[1].mask``; None when every row sees every column)."""
        n = q.shape[1]
        keys, values = cache.update(k[None], v[None], i)
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        if self.native is not None:
            seen = None if mask is None else mask.reshape(n, -1).contiguous()
            return self.native.attend(q, keys, values, seen, self.scaling)
        if n == 1:  # one query: each key head's group of query heads as its rows
            out = F.scaled_dot_product_attention(
                q.view(1, kv, h // kv, d), keys, values, attn_mask=mask, scale=self.scaling
            )
            return out.reshape(1, h * d)
        if h != kv and q.dtype != torch.float32:  # the bf16 CPU kernel is slow with GQA:
            keys, values = (  # each key head repeated for its query heads, as transformers does
                t[:, :, None].expand(1, kv, h // kv, *t.shape[2:]).reshape(1, h, *t.shape[2:])
                for t in (keys, values)
            )
        out = F.scaled_dot_product_attention(
            q[None], keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=h != keys.shape[1]
        )
        return out[0].transpose(0, 1).reshape(n, h * d)

    def attend_all(
        self,
        i: int,
        caches: Sequence[SinkWindowCache],
        bounds: Sequence[int],
        masks: Sequence[torch.Tensor | None],
        seen: Sequence[torch.Tensor | None],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spans: Sequence[tuple[torch.Tensor, torch.Tensor, int, int] | None] | None = None,
    ) -> torch.Tensor:
        """Layer ``i``'s attention output ``[rows, heads * head_dim]`` of the rows of several
        caches (cache ``j``'s rows ``bounds[j]:bounds[j + 1]`` of :meth:`qkv`'s ``q``, ``k``,
        ``v``; ``masks[j]`` its layout as :meth:`attend` takes it, ``seen[j]`` the same as
        ``[rows, columns]``, contiguous). With the compiled step operations, past the first
        layer (which opens each block) or where the caller opened the blocks and took the
        spans, every cache whose block is one run of slots is written and attended in one
        compiled call (``attend_many``: one parallel region, no slicing of the storage); the
        others, and every cache without them, go through :meth:`attend`. ``spans``: each
        cache's ``span_slots`` for this layer, when the caller took them already."""
        if self.native is None or (i == 0 and spans is None):
            outs = [
                self.attend(i, cache, q[:, a:b], k[:, a:b], v[:, a:b], mask)
                for cache, a, b, mask in zip(caches, bounds, bounds[1:], masks)
            ]
            return torch.cat(outs) if len(outs) > 1 else outs[0]
        out = q.new_empty(q.shape[1], q.shape[0] * q.shape[2])
        fast: list[int] = []
        slots: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        for j, (cache, a, b) in enumerate(zip(caches, bounds, bounds[1:])):
            span = cache.span_slots(i, b - a) if spans is None else spans[j]
            if span is None:
                out[a:b] = self.attend(i, cache, q[:, a:b], k[:, a:b], v[:, a:b], masks[j])
            else:
                fast.append(j)
                slots.append(span)
        if not fast:
            return out
        if len(fast) == len(caches):
            qf, kf, vf, of = q, k, v, out
        else:  # those caches' rows only, copied back below
            rows = torch.cat([torch.arange(bounds[j], bounds[j + 1]) for j in fast])
            qf, kf, vf = q[:, rows], k[:, rows], v[:, rows]
            of = out.new_empty(len(rows), out.shape[1])
        sub = [0]
        for j in fast:
            sub.append(sub[-1] + bounds[j + 1] - bounds[j])
        self.attend_many_calls += 1
        self.native.attend_many(
            of,
            qf,
            kf,
            vf,
            [s[0] for s in slots],
            [s[1] for s in slots],
            sub,
            [s[2] for s in slots],
            [s[3] for s in slots],
            [seen[j] for j in fast],
            self.scaling,
        )
        if of is not out:
            out[rows] = of
        return out

    def layer(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: Sequence[SinkWindowCache],
        bounds: Sequence[int],
        masks: Sequence[torch.Tensor | None],
        seen: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        """Layer ``i``'s output rows of the rows ``x`` of ``caches`` (as :meth:`attend_all`
        takes them): one compiled call where :meth:`compiled_for` and every cache's block is
        one run of slots, else :meth:`qkv`, :meth:`attend_all` and :meth:`finish_layer`.
        Layer 0 opens each cache's block (``SinkWindowCache.open_block``) first when it
        runs compiled."""
        spans = None
        if self.compiled_for(i, x, len(caches)):
            if i == 0:
                for c, a, b in zip(caches, bounds, bounds[1:]):
                    c.open_block(b - a)
            spans = [c.span_slots(i, b - a) for c, a, b in zip(caches, bounds, bounds[1:])]
            ready = [span for span in spans if span is not None]
            if len(ready) == len(spans):
                return self.compiled_layer(i, x, cos, sin, ready, bounds, seen)
        q, k, v = self.qkv(i, x, cos, sin)
        return self.finish_layer(
            i, x, self.attend_all(i, caches, bounds, masks, seen, q, k, v, spans)
        )

    def finish_layer(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s output rows: ``x`` plus the output projection of ``attended``
        (from :meth:`attend`), then plus the MLP of that."""
        layer = self.layers[i]
        x = x + _product(layer.o_proj, attended)
        gate, up = _product(layer.gate_up, self._rms(x, layer.norm2)).chunk(2, dim=-1)
        return x + _product(layer.down, F.silu(gate) * up)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 logits ``[rows, vocab]`` of the last layer's rows ``x``."""
        return _product(self.lm_head, self._rms(x, self.norm)).float()

    def _rms(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        """``norm(x)`` (:func:`_rms`), compiled where it applies."""
        if self.native is not None and x.is_contiguous():
            return self.native.rms_norm(x, norm.weight, norm.variance_epsilon)
        return _rms(x, norm)

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
        x = self.embed(token_ids)
        # consecutive positions, or each node's depth inside a draft tree's forward
        cos, sin = self.rope(x, cache.plan.block_positions(n).tolist())
        mask, seen = step_mask(cache.get_mask_sizes(n, 0)[1], n)
        for i in range(len(self.layers)):
            x = self.layer(i, x, cos, sin, [cache], [0, n], [mask], [seen])
        return self.logits(x if all_rows else x[-1:])
