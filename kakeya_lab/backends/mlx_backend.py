"""The MLX backend: the same sink-window semantics on an mlx-lm model.

* :func:`load_mlx_model` loads a store folder written by transformers (safetensors +
  ``config.json``) with ``mlx_lm.utils.load_model`` — no network, never remote code — and
  casts every floating parameter to the requested dtype (mlx-lm keeps the stored dtype; it
  does not cast by itself). Supported architectures: :data:`SUPPORTED_MODEL_TYPES`.
* :class:`SinkWindowKVCache` — one per layer, plugged into mlx-lm's models as their cache
  list: they call ``cache.update_and_fetch(keys, values)``, rotate with ``cache.offset``
  and build the mask with ``create_attention_mask(h, cache[0])``, which calls
  ``cache.make_mask(N, ...)``. Each layer's state is in plain attributes (``keys``,
  ``values``, ``offset``); the layers of one model share a non-compact
  :class:`~kakeya_lab.backends.plan.SlotPlan` (which absolute position each slot holds,
  where a block goes, its key layout and sink copies, eviction) — the same plan as the
  torch cache, except that eviction only frees slots (moving entries would copy whole MLX
  arrays) and a new block fills free slots, lowest first. A provisional entry never takes
  a committed entry's slot, so rollback works after the window has wrapped; eviction only
  in :meth:`MLXSinkWindowCache.commit`, ``kv_live_bytes`` from the arrays held.
* :class:`MLXBackend` — the :class:`~kakeya_lab.backends.seam.Backend` the verifier sits
  on (registered as ``"mlx"``).
* :func:`mlx_dense_logits` — the dense masked forward on MLX (the oracle).

Draft trees (docs/design.md, "Draft trees"), as on torch: in a tree forward each node is
stored at ``next_position + depth`` (nodes of one depth share a position), the mask adds the
tree's ancestor mask on the block's own columns, and RoPE rotates each node at its depth:
mlx-lm rotates a block at consecutive positions, so every attention's ``rope`` is wrapped
once (``TreeRope``) to rotate a tree block on by ``depth - index`` (a context variable
holds the plan's shifts, so other threads' forwards are untouched). Committing a root-to-node path
(:meth:`MLXSinkWindowCache.select`) only relabels slots: the path's entries already sit at
their final positions and slots need not be contiguous, so no data moves.

Rolling positions: the plan's sink copies (:mod:`kakeya_lab.backends.plan`), rotated here
with rotate-half RoPE at the model's default frequencies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.plan import Block, SlotPlan, visibility
from kakeya_lab.backends.seam import CacheBackend, Forward, interrupts_deferred

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def load_mlx_model(folder: Path, dtype: str = "float32") -> Any:
    """Load the transformers-written store ``folder`` as an mlx-lm model in ``dtype``.

    Raises ValueError for an architecture outside :data:`SUPPORTED_MODEL_TYPES`, a quantized
    checkpoint, a config that asks for custom code, or an unknown dtype;
    FileNotFoundError without ``config.json`` or safetensors.
    """
    import mlx.core as mx
    from mlx_lm.utils import load_model

    folder = Path(folder)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES.values()))}")
    config_path = folder / "config.json"
    if not config_path.is_file() or not list(folder.glob("model*.safetensors")):
        raise FileNotFoundError(
            f"{folder} needs config.json and model*.safetensors (a kakeya_lab store folder)"
        )
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the MLX backend supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"{folder} is {model_type!r} ({config.get('architectures')}): use backend='torch'"
        )
    if "quantization_config" in config or "quantization" in config:
        raise ValueError(
            f"{folder} is quantized; the MLX backend loads floating-point weights only"
        )
    if config.get("model_file") is not None:
        raise ValueError(
            f"{folder} asks for custom model code ({config['model_file']!r}); never loaded"
        )
    overrides: dict[str, Any] = {}
    rope = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None and "rope_theta" in rope:
        # transformers >= 5 nests rope_theta under rope_parameters; mlx-lm's llama reads the top level
        overrides["rope_theta"] = rope["rope_theta"]
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        overrides["rope_scaling"] = rope
    model, _ = load_model(
        folder, lazy=False, strict=True, model_config=overrides, trust_remote_code=False
    )
    model.set_dtype(getattr(mx, _DTYPES[dtype]))
    mx.eval(model.parameters())
    model.eos_token_ids = _declared_eos_ids(
        folder, config
    )  # mlx-lm models carry no generation config
    return model


def load_folder(folder: Path, dtype: str = "float32") -> Any:
    """The registry's loader: :func:`load_mlx_model`."""
    return load_mlx_model(folder, dtype)


def _declared_eos_ids(folder: Path, config: dict) -> frozenset[int]:
    """EOS ids from generation_config.json (as transformers reads them), else config.json."""
    generation = folder / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    if eos is None:
        eos = config.get("eos_token_id")
    return frozenset([eos] if isinstance(eos, int) else list(eos or []))


def _dims(model: Any) -> tuple[int, int, int, int]:
    args = model.args
    n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    return len(model.layers), n_kv, head_dim, args.vocab_size


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys plus values one cached token takes over all layers of an mlx-lm model
    (its weights' dtype: the cache stores keys and values in it)."""
    from mlx.utils import tree_flatten

    n_layers, n_kv, head_dim, _ = _dims(model)
    leaves = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    return 2 * n_layers * n_kv * head_dim * int(leaves[0][1].itemsize)


def _rope_inv_freq(model: Any, head_dim: int) -> np.ndarray:
    import mlx.nn as nn

    rope = getattr(model.layers[0].self_attn, "rope", None)
    if isinstance(rope, _tree_rope_type()):  # a tree-aware wrapper: read the RoPE inside
        rope = cast(Any, rope).inner
    if (
        not isinstance(rope, nn.RoPE)
        or rope.traditional
        or rope.dims != head_dim
        or getattr(rope, "scale", 1.0) != 1.0
    ):
        raise ValueError(
            "default full-width rotate-half RoPE is needed (this model has "
            f"{type(rope).__name__}{' (traditional)' if getattr(rope, 'traditional', False) else ''})"
        )
    return 1.0 / (rope.base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def _rotate(x: Any, shift: np.ndarray, inv_freq: np.ndarray) -> Any:
    """Rotate already-rotated ``x`` ``[..., n, d]`` forward by ``shift[n]`` positions (rotate-half)."""
    import mlx.core as mx

    angles = shift.astype(np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos = mx.array(np.cos(emb).astype(np.float32)).astype(x.dtype)
    sin = mx.array(np.sin(emb).astype(np.float32)).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated_half * sin


# per-token RoPE shifts of the tree forward under way in this thread (None: no tree)
_TREE_SHIFTS: ContextVar[np.ndarray | None] = ContextVar("kakeya_tree_shifts", default=None)


@lru_cache(maxsize=1)
def _tree_rope_type() -> type:
    """The RoPE wrapper class (defined on first use: mlx is imported lazily)."""
    import mlx.nn as nn

    class TreeRope(nn.Module):
        """An attention's RoPE that, during a tree forward, rotates the block on from
        consecutive positions to its nodes' depths (see the module doc)."""

        def __init__(self, inner: Any, inv_freq: np.ndarray):
            super().__init__()
            self.inner = inner
            object.__setattr__(self, "_inv_freq", inv_freq)  # kept out of the parameters

        def __call__(self, x: Any, offset: int = 0) -> Any:
            out = self.inner(x, offset=offset)
            shifts = _TREE_SHIFTS.get()
            if shifts is None:
                return out
            return _rotate(out, shifts, self._inv_freq)

    return TreeRope


def tree_inv_freq(model: Any) -> np.ndarray:
    """The RoPE frequencies a tree forward rotates with; NotImplementedError for a RoPE
    variant the depth rotation cannot reproduce (traditional, partial or scaled)."""
    try:
        return _rope_inv_freq(model, _dims(model)[2])
    except ValueError as exc:
        raise NotImplementedError(
            f"draft trees on MLX rotate nodes by depth: {exc}; verify trees on torch"
        ) from None


def _install_tree_rope(model: Any) -> None:
    """Wrap every attention's ``rope`` once (idempotent; see :func:`tree_inv_freq`)."""
    inv_freq = tree_inv_freq(model)
    wrapper = _tree_rope_type()
    for layer in model.layers:
        if not isinstance(layer.self_attn.rope, wrapper):
            layer.self_attn.rope = wrapper(layer.self_attn.rope, inv_freq)


class SinkWindowKVCache:
    """One layer's sink-window cache in mlx-lm's cache protocol (``update_and_fetch``,
    ``offset``, ``make_mask``, ``state``, ``nbytes``); its owner holds the shared plan and
    the open forward's block."""

    step = 256  # slots added at a time

    def __init__(self, owner: MLXSinkWindowCache, index: int):
        self.owner = owner
        self.index = index
        self.keys: Any = None  # mx.array [1, kv_heads, capacity, head_dim] once written
        self.values: Any = None
        self.offset = 0  # position of this layer's next token (RoPE offset)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:

        owner, plan = self.owner, self.owner.plan
        n = keys.shape[2]
        if keys.shape[0] != 1:
            raise ValueError("the sink-window cache holds one sequence (batch size 1)")
        if self.index == 0:
            owner.check_forward_complete("roll back first")
            owner.block = plan.open(n)
            owner.layers_done = 0
        elif owner.block is None or owner.layers_done != self.index or owner.block.slots.size != n:
            raise RuntimeError(f"layer {self.index} updated out of order")
        block = owner.block
        if self.keys is None or self.keys.shape[2] < plan.capacity:
            self._grow(keys, values, plan.capacity)
        span = block.span
        if span is not None:  # contiguous: a slice write
            self.keys[..., span[0] : span[1], :] = keys
            self.values[..., span[0] : span[1], :] = values
        else:
            idx = mx_index(block.slots)
            self.keys[:, :, idx] = keys
            self.values[:, :, idx] = values
        copies = block.layout.copies
        if copies is not None:
            if owner.inv_freq is None:  # the cache sets it whenever rolling positions evict
                raise RuntimeError("rolling sink copies need the model's rotary frequencies")
            idx = mx_index(copies.column_sources)
            self.keys[..., block.columns : block.stop, :] = _rotate(
                self.keys[:, :, idx], copies.column_shifts, owner.inv_freq
            )
            self.values[..., block.columns : block.stop, :] = self.values[:, :, idx]
        self.offset += n
        owner.layers_done = self.index + 1
        return self.keys[..., : block.stop, :], self.values[..., : block.stop, :]

    def _grow(self, keys: Any, values: Any, capacity: int) -> None:
        import mlx.core as mx

        capacity = self.step * -(-capacity // self.step)
        new_k = mx.zeros((1, keys.shape[1], capacity, keys.shape[3]), keys.dtype)
        new_v = mx.zeros((1, values.shape[1], capacity, values.shape[3]), values.dtype)
        if self.keys is not None:
            held = self.keys.shape[2]
            new_k[..., :held, :] = self.keys
            new_v[..., :held, :] = self.values
        self.keys, self.values = new_k, new_v

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The boolean mask ``[N, columns]`` of the next forward (changes nothing)."""
        import mlx.core as mx

        if window_size is not None:
            raise ValueError("sliding-window layers are not supported by the sink-window cache")
        return mx.array(self.owner.plan.plan(N).layout.visible)

    def live_nbytes(self) -> int:
        """Bytes of this layer's committed K and V entries (slot size read from the arrays)."""
        if self.keys is None:
            return 0
        slots = self.keys.shape[2]
        return (self.keys.nbytes // slots + self.values.nbytes // slots) * self.owner.plan.used

    @property
    def state(self) -> tuple[Any, Any]:
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return self.live_nbytes()

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return self.keys is None


def mx_index(indices: np.ndarray) -> Any:
    import mlx.core as mx

    return mx.array(indices.astype(np.int32))


class MLXSinkWindowCache:
    """The layer caches of one mlx-lm model (``layers``, passed as the model's cache list),
    their shared :class:`~kakeya_lab.backends.plan.SlotPlan` (``plan``) and the commit /
    rollback verbs over them. ``block``: the open forward's block once layer 0 stored it;
    ``layers_done``: how many layers stored it."""

    def __init__(self, model: Any, config: SinkWindowConfig):
        n_layers, self.num_kv_heads, self.head_dim, _ = _dims(model)
        self.inv_freq: np.ndarray | None = None
        if config.positions == "rolling" and config.evicts:
            try:
                self.inv_freq = _rope_inv_freq(model, self.head_dim)
            except ValueError as exc:
                raise ValueError(
                    f"rolling positions on MLX re-rotate sink keys: {exc}; use positions='global'"
                ) from None
        self.config = config
        self.plan = SlotPlan(config, compact=False)
        self.block: Block | None = None
        self.layers_done = 0
        self.layers = [SinkWindowKVCache(self, i) for i in range(n_layers)]

    @property
    def cache_len(self) -> int:
        return self.plan.used

    @property
    def pending_len(self) -> int:
        return self.plan.pending_len

    @property
    def next_position(self) -> int:
        return self.plan.next_position

    def check_forward_complete(self, only: str = "only rollback() is possible") -> None:
        """RuntimeError if the last forward stopped midway (not every layer stored its block)."""
        if self.block is not None and self.layers_done != len(self.layers):
            raise RuntimeError(f"the last forward stopped midway; {only}")

    def _sync_offsets(self) -> None:
        self.block = None
        for layer in self.layers:
            layer.offset = self.plan.next_position

    def commit(self, n: int) -> None:
        if not 0 <= n <= self.plan.pending_len:
            raise ValueError(f"commit({n}) with {self.plan.pending_len} provisional entries")
        self.check_forward_complete()
        with interrupts_deferred():
            self.plan.commit(n)  # eviction frees slots; no data moves
            self._sync_offsets()

    def select(self, indices: Sequence[int]) -> None:
        """Keep provisional entries ``indices`` (a draft tree's root-to-node path) as the
        open block and drop the rest; then ``commit(len(indices))`` commits the path. Only
        slot labels change (see the module doc); ValueError, nothing changed, if
        ``indices`` is not such a path."""
        self.check_forward_complete()
        self.plan.select(indices)

    @contextmanager
    def tree_forward(self, tree: Any, model: Any) -> Iterator[None]:
        """Within the block, the next forward is the :class:`~kakeya_lab.tree.DraftTree`
        ``tree``: entries at ``next_position + depth`` under its ancestor mask, RoPE by depth."""
        if self.plan.pending_len:
            raise RuntimeError("a draft tree is verified on its own: commit or roll back first")
        _install_tree_rope(model)
        self.plan.set_tree(tree.depths(), tree.ancestor_mask().numpy())
        token = _TREE_SHIFTS.set(self.plan.tree_rope_shifts())
        try:
            yield
        finally:
            _TREE_SHIFTS.reset(token)
            self.plan.set_tree(None)

    def rollback(self, keep: int = 0) -> None:
        """Drop provisional entries (all, or all but the first ``keep``)."""
        self.plan.drop_provisional(keep)
        self._sync_offsets()

    def reset(self) -> None:
        for layer in self.layers:
            layer.keys = layer.values = None
        self.plan.reset()
        self._sync_offsets()

    def cached_positions(self) -> list[int]:
        return self.plan.cached_positions()

    def kv_live_bytes(self) -> int:
        return sum(layer.live_nbytes() for layer in self.layers)

    def kv_budget_bytes(self) -> int | None:
        first = self.layers[0]
        if self.config.budget is None or first.keys is None:
            return None
        itemsize = first.keys.itemsize
        return (
            self.config.budget * len(self.layers) * self.num_kv_heads * self.head_dim * itemsize * 2
        )


def _to_torch(x: Any) -> torch.Tensor:
    import mlx.core as mx

    return torch.from_numpy(np.array(x.astype(mx.float32)))


def make_backend(
    model: Any,
    config: SinkWindowConfig,
    *,
    block_padding: Mapping[int, int] | None = None,
    lean: bool | None = None,
) -> MLXBackend:
    """The registry's constructor: an :class:`MLXBackend` (no block padding; ``lean``
    changes nothing: MLX has one forward)."""
    if block_padding and any(n != m for n, m in block_padding.items()):
        raise ValueError("block padding is implemented on the torch backend only")
    return MLXBackend(model, config)


def vocab_size_of(model: Any) -> int:
    """The model's ``args.vocab_size``."""
    return int(_dims(model)[3])


def check_tree_support(model: Any) -> None:
    """NotImplementedError for a RoPE variant the depth rotation cannot reproduce."""
    tree_inv_freq(model)


class MLXBackend(CacheBackend):
    """An mlx-lm causal LM over an :class:`MLXSinkWindowCache` (see
    :class:`kakeya_lab.backends.seam.Backend`)."""

    name = "mlx"

    def __init__(self, model: Any, config: SinkWindowConfig):
        self.model = model
        self.config = config
        self.vocab_size = _dims(model)[3]
        self.cache = MLXSinkWindowCache(model, config)

    def forward(
        self,
        token_ids: Sequence[int],
        *,
        all_rows: bool,
        hidden: bool = False,
        tree: Any = None,
    ) -> Forward:
        import mlx.core as mx

        if hidden:
            raise NotImplementedError(
                "final hidden states are only available on the torch backend; a hidden-state "
                "drafter cannot be bound to an MLX verifier"
            )
        before = self.cache.pending_len
        shape = self.cache.tree_forward(tree, self.model) if tree is not None else nullcontext()
        try:
            with shape:
                logits = self.model(mx.array([list(token_ids)]), cache=self.cache.layers)
                logits = logits[0] if all_rows else logits[0, -1:]
                mx.eval(logits)
        except BaseException:
            self.cache.rollback(keep=before)  # drop this forward's partial block only
            raise
        return Forward(_to_torch(logits))


class _DenseMask:
    """A cache-protocol object that stores nothing and hands mlx-lm the dense sink-window mask."""

    def __init__(self, mask: Any):
        self.mask = mask
        self.offset = 0

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return self.mask


def mlx_dense_logits(
    model: Any, token_ids: Sequence[int], config: SinkWindowConfig
) -> torch.Tensor:
    """Next-token logits ``[n, vocab]`` (float32 torch) for every position, one dense MLX
    forward with the sink-window mask — the MLX oracle. Like
    :func:`kakeya_lab.reference.dense_logits`, rolling positions past the budget raise."""
    import mlx.core as mx

    ids = list(token_ids)
    n = len(ids)
    if config.positions == "rolling" and config.budget is not None and n > config.budget:
        raise ValueError(
            f"rolling positions differ from the dense mask past the budget ({config.budget}); "
            "use kakeya_lab.reference.rolling_logits"
        )
    positions = np.arange(n)
    mask = mx.array(visibility(positions, positions, config.sink, config.window))
    caches = [_DenseMask(mask) for _ in model.layers]
    logits = model(mx.array([ids]), cache=caches)[0]
    mx.eval(logits)
    return _to_torch(logits)


def mlx_early_exit_model(model: Any, num_layers: int) -> Any:
    """An mlx-lm model made of ``model``'s embedding, first ``num_layers`` layers, final norm
    and head — sharing the weight arrays (no copy). The MLX counterpart of
    :func:`kakeya_lab.proposers.early_exit_model`."""
    import copy

    from mlx.utils import tree_flatten

    total = len(model.layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"early exit needs 1 <= num_layers < {total}, got {num_layers}")
    args = copy.deepcopy(model.args)
    args.num_hidden_layers = num_layers
    if getattr(args, "layer_types", None) is not None:
        args.layer_types = list(args.layer_types)[:num_layers]
    draft = type(model)(args)
    kept = []
    # without ``destination`` tree_flatten returns the list of (name, array) pairs
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    for name, array in flat:
        parts = name.split(".")
        if "layers" in parts:
            index = int(parts[parts.index("layers") + 1])
            if index >= num_layers:
                continue
        kept.append((name, array))
    draft.load_weights(kept, strict=True)
    draft.eval()
    return draft
