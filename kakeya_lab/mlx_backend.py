"""The MLX backend: the same sink-window semantics on an mlx-lm model.

* :func:`load_mlx_model` loads a store folder written by transformers (safetensors +
  ``config.json``) with ``mlx_lm.utils.load_model`` — no network, never remote code — and
  casts every floating parameter to the requested dtype (mlx-lm keeps the stored dtype; it
  does not cast by itself). Supported architectures: :data:`SUPPORTED_MODEL_TYPES`.
* :class:`SinkWindowKVCache` — one per layer, plugged into mlx-lm's models as their cache
  list: they call ``cache.update_and_fetch(keys, values)``, rotate with ``cache.offset``
  and build the mask with ``create_attention_mask(h, cache[0])``, which calls
  ``cache.make_mask(N, ...)``. Each layer's state is in plain attributes (``keys``,
  ``values``, ``offset``); the layers of one model share a :class:`MLXSlotTable` (which
  absolute position each slot holds). Same storage rule as the torch cache: committed
  entries in slots ``[0, used)``, a provisional block after them (never overwriting a
  committed entry, so rollback works after the window has wrapped), eviction only in
  :meth:`MLXSinkWindowCache.commit`, ``kv_live_bytes`` from the arrays held.
* :class:`MLXBackend` — the :class:`~kakeya_lab.backend.Backend` the verifier sits on.
* :func:`mlx_dense_logits` — the dense masked forward on MLX (the oracle).

Draft trees (docs/design.md, "Draft trees"), as on torch: in a tree forward each node is
stored at ``next_position + depth`` (nodes of one depth share a position), the mask adds the
tree's ancestor mask on the block's own columns, and RoPE rotates each node at its depth:
mlx-lm rotates a block at consecutive positions, so every attention's ``rope`` is wrapped
once (``TreeRope``) to rotate a tree block on by ``depth - index`` (a context variable
holds the shifts, so other threads' forwards are untouched). Committing a root-to-node path
(:meth:`MLXSinkWindowCache.select`) only relabels slots: the path's entries already sit at
their final positions and slots need not be contiguous, so no data moves.

Rolling positions, multi-token blocks: as on torch (:mod:`kakeya_lab.attention`), each query
past ``sink + window - 1`` gets its own copies of the sink keys rotated forward by
``p - (sink + window - 1)`` (rotate-half RoPE, default frequencies), appended as extra key
columns in scratch slots after the block; the boolean mask shows query ``p`` only its own
copies and hides the original sink columns from it. Exact in one forward; the cost is
``sink`` extra key columns per such query (``sink`` for single-token decoding).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from kakeya_lab.backend import CacheBackend, Forward
from kakeya_lab.cache import SinkWindowConfig

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


def check_tree_support(model: Any) -> np.ndarray:
    """The RoPE frequencies a tree forward rotates with; NotImplementedError for a RoPE
    variant the depth rotation cannot reproduce (traditional, partial or scaled)."""
    try:
        return _rope_inv_freq(model, _dims(model)[2])
    except ValueError as exc:
        raise NotImplementedError(
            f"draft trees on MLX rotate nodes by depth: {exc}; verify trees on torch"
        ) from None


def _install_tree_rope(model: Any) -> None:
    """Wrap every attention's ``rope`` once (idempotent; see :func:`check_tree_support`)."""
    inv_freq = check_tree_support(model)
    wrapper = _tree_rope_type()
    for layer in model.layers:
        if not isinstance(layer.self_attn.rope, wrapper):
            layer.self_attn.rope = wrapper(layer.self_attn.rope, inv_freq)


def visibility(
    query_positions: np.ndarray, key_positions: np.ndarray, sink: int, window: int | None
) -> np.ndarray:
    """The oracle mask ``[q, k]`` (True = attend) from absolute positions."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= (k < sink) | (q - k < window)
    return visible


class MLXSlotTable:
    """Which absolute position each slot holds (``-1``: free), shared by one model's layer caches.

    Unlike the torch table, committed entries need not be a dense prefix: eviction only
    frees slots (no data moves, which would copy whole MLX arrays), and a new block is
    written into free slots, lowest first. A provisional entry never takes a committed
    entry's slot, so rollback works after the window has wrapped. ``used`` committed
    entries; ``pending_slots`` the open block's slots in position order; ``block`` the
    open forward's ``(slots, columns, copy_columns, copy_shifts)`` once layer 0 stored it.
    """

    def __init__(self, config: SinkWindowConfig, num_layers: int, inv_freq: np.ndarray | None):
        self.config = config
        self.num_layers = num_layers
        self.inv_freq = inv_freq
        self.reset()

    def reset(self) -> None:
        self.positions = np.full(0, -1, dtype=np.int64)
        self.used = self.history_len = 0
        self.pending_slots = np.zeros(0, dtype=np.int64)
        self.block: tuple[np.ndarray, int, np.ndarray | None, np.ndarray | None] | None = None
        self.layers_done = 0
        self.tree: tuple[np.ndarray, np.ndarray] | None = None  # (depths, ancestor mask)

    @property
    def pending_len(self) -> int:
        return self.pending_slots.size

    @property
    def next_position(self) -> int:
        return self.history_len + self.pending_len

    def _block_positions(self, n: int) -> np.ndarray:
        """Positions of the next ``n`` entries: consecutive, or by depth for a tree."""
        if self.tree is not None:
            return self.next_position + self.tree[0]
        return np.arange(self.next_position, self.next_position + n, dtype=np.int64)

    def _plan(self, n: int) -> tuple[np.ndarray, int, np.ndarray]:
        """Slots for the next n entries, the key columns ``[0, columns)`` the forward returns,
        and the position of every column."""
        free = np.nonzero(self.positions == -1)[0][:n]
        if free.size < n:
            free = np.concatenate(
                [free, np.arange(self.positions.size, self.positions.size + n - free.size)]
            )
        occupied = np.nonzero(self.positions >= 0)[0]
        columns = int(max(free.max(), occupied.max() if occupied.size else -1)) + 1
        keys = np.full(columns, -1, dtype=np.int64)
        held = min(columns, self.positions.size)
        keys[:held] = self.positions[:held]
        keys[free] = self._block_positions(n)
        return free, columns, keys

    def layout(self, n: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(visible [n, columns], copy source columns, copy shifts)`` of the next n-token forward."""
        c = self.config
        free, _, keys = self._plan(n)
        queries = self._block_positions(n)
        visible = visibility(queries, keys, c.sink, c.window)
        if self.tree is not None:  # inside the block, a node sees only its own path
            visible[:, free] &= self.tree[1]
        if c.positions != "rolling" or c.window is None:
            return visible, None, None
        shift = np.maximum(queries - (c.sink + c.window - 1), 0)
        rows = np.nonzero(shift > 0)[0]
        cols = np.nonzero((keys >= 0) & (keys < c.sink))[0]
        if not rows.size or not cols.size:
            return visible, None, None
        s, m = cols.size, rows.size
        copies = np.zeros((n, m * s), dtype=bool)
        copies[np.repeat(rows, s), np.arange(m * s)] = visible[np.ix_(rows, cols)].reshape(-1)
        visible[np.ix_(rows, cols)] = False
        return np.concatenate([visible, copies], axis=1), cols, shift[rows]

    def open(self, n: int) -> tuple[np.ndarray, int, np.ndarray | None, np.ndarray | None]:
        _, cols, shifts = self.layout(n)
        slots, columns, _ = self._plan(n)
        needed = columns + (0 if cols is None or shifts is None else cols.size * shifts.size)
        if needed > self.positions.size:
            grown = np.full(max(needed, 2 * self.positions.size, 16), -1, dtype=np.int64)
            grown[: self.positions.size] = self.positions
            self.positions = grown
        self.positions[slots] = self._block_positions(n)
        self.pending_slots = np.concatenate([self.pending_slots, slots])
        self.block = (slots, columns, cols, shifts)
        self.layers_done = 0
        return self.block

    def commit(self, n: int) -> None:
        self.positions[self.pending_slots[n:]] = -1
        self.pending_slots = np.zeros(0, dtype=np.int64)
        self.history_len += n
        self.block = None
        window = self.config.window
        if window is not None:  # a full cache never evicts
            pos = self.positions
            evicted = (pos >= self.config.sink) & (pos < self.history_len - window)
            pos[evicted] = -1
        self.used = int((self.positions >= 0).sum())

    def drop_provisional(self, keep: int = 0) -> None:
        self.positions[self.pending_slots[keep:]] = -1
        self.pending_slots = self.pending_slots[:keep]
        self.block = None

    def select(self, indices: Sequence[int]) -> None:
        """Keep provisional entries ``indices`` (a draft tree's root-to-node path: they
        must hold consecutive positions from ``history_len``) as the open block, dropping
        the others; ValueError, nothing changed, else."""
        idx = np.asarray(list(indices), dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.pending_len):
            raise ValueError(
                f"provisional entries {list(indices)} outside 0..{self.pending_len - 1}"
            )
        want = np.arange(self.history_len, self.history_len + idx.size)
        if not np.array_equal(self.positions[self.pending_slots[idx]], want):
            raise ValueError(
                f"provisional entries {list(indices)} are not a path of consecutive positions "
                f"from {self.history_len}"
            )
        dropped = np.setdiff1d(np.arange(self.pending_len), idx)
        self.positions[self.pending_slots[dropped]] = -1
        self.pending_slots = self.pending_slots[idx]


class SinkWindowKVCache:
    """One layer's sink-window cache in mlx-lm's cache protocol (``update_and_fetch``,
    ``offset``, ``make_mask``, ``state``, ``nbytes``)."""

    step = 256  # slots added at a time

    def __init__(self, table: MLXSlotTable, index: int):
        self.table = table
        self.index = index
        self.keys: Any = None  # mx.array [1, kv_heads, capacity, head_dim] once written
        self.values: Any = None
        self.offset = 0  # position of this layer's next token (RoPE offset)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        t = self.table
        n = keys.shape[2]
        if keys.shape[0] != 1:
            raise ValueError("the sink-window cache holds one sequence (batch size 1)")
        if self.index == 0:
            if t.block is not None and t.layers_done != t.num_layers:
                raise RuntimeError("the previous forward stopped midway; roll back first")
            block = t.open(n)
        elif t.block is None or t.layers_done != self.index or t.block[0].size != n:
            raise RuntimeError(f"layer {self.index} updated out of order")
        else:
            block = t.block
        slots, end, cols, shifts = block
        if self.keys is None or self.keys.shape[2] < t.positions.size:
            self._grow(keys, values, t.positions.size)
        first = int(slots[0])
        if n == 1 or int(slots[-1]) - first == n - 1:  # contiguous: a slice write
            self.keys[..., first : first + n, :] = keys
            self.values[..., first : first + n, :] = values
        else:
            idx = mx_index(slots)
            self.keys[:, :, idx] = keys
            self.values[:, :, idx] = values
        if cols is not None and shifts is not None:
            if t.inv_freq is None:  # the cache sets it whenever rolling positions evict
                raise RuntimeError("rolling sink copies need the model's rotary frequencies")
            m, s = shifts.size, cols.size
            idx = mx_index(cols)
            sink_keys = mx.tile(self.keys[:, :, idx], (1, 1, m, 1))
            self.keys[..., end : end + m * s, :] = _rotate(
                sink_keys, np.repeat(shifts, s), t.inv_freq
            )
            self.values[..., end : end + m * s, :] = mx.tile(self.values[:, :, idx], (1, 1, m, 1))
            end += m * s
        self.offset += n
        t.layers_done = self.index + 1
        return self.keys[..., :end, :], self.values[..., :end, :]

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
        visible, _, _ = self.table.layout(N)
        return mx.array(visible)

    def live_nbytes(self) -> int:
        """Bytes of this layer's committed K and V entries (slot size read from the arrays)."""
        if self.keys is None:
            return 0
        slots = self.keys.shape[2]
        return (self.keys.nbytes // slots + self.values.nbytes // slots) * self.table.used

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
    """The layer caches of one mlx-lm model (``layers``, passed as the model's cache list)
    and the commit / rollback verbs over them."""

    def __init__(self, model: Any, config: SinkWindowConfig):
        n_layers, self.num_kv_heads, self.head_dim, _ = _dims(model)
        inv_freq = None
        if config.positions == "rolling" and config.evicts:
            try:
                inv_freq = _rope_inv_freq(model, self.head_dim)
            except ValueError as exc:
                raise ValueError(
                    f"rolling positions on MLX re-rotate sink keys: {exc}; use positions='global'"
                ) from None
        self.config = config
        self.table = MLXSlotTable(config, n_layers, inv_freq)
        self.layers = [SinkWindowKVCache(self.table, i) for i in range(n_layers)]

    @property
    def cache_len(self) -> int:
        return self.table.used

    @property
    def pending_len(self) -> int:
        return self.table.pending_len

    @property
    def next_position(self) -> int:
        return self.table.next_position

    def _sync_offsets(self) -> None:
        for layer in self.layers:
            layer.offset = self.table.next_position

    def commit(self, n: int) -> None:
        from kakeya_lab.cache import interrupts_deferred

        if not 0 <= n <= self.table.pending_len:
            raise ValueError(f"commit({n}) with {self.table.pending_len} provisional entries")
        if self.table.block is not None and self.table.layers_done != self.table.num_layers:
            raise RuntimeError("the last forward stopped midway; only rollback() is possible")
        with interrupts_deferred():
            self.table.commit(n)  # eviction frees slots; no data moves
            self._sync_offsets()

    def select(self, indices: Sequence[int]) -> None:
        """Keep provisional entries ``indices`` (a draft tree's root-to-node path) as the
        open block and drop the rest; then ``commit(len(indices))`` commits the path. Only
        slot labels change (see the module doc); ValueError, nothing changed, if
        ``indices`` is not such a path."""
        if self.table.block is not None and self.table.layers_done != self.table.num_layers:
            raise RuntimeError("the last forward stopped midway; only rollback() is possible")
        self.table.select(indices)

    @contextmanager
    def tree_forward(self, tree: Any, model: Any) -> Iterator[None]:
        """Within the block, the next forward is the :class:`~kakeya_lab.tree.DraftTree`
        ``tree``: entries at ``next_position + depth`` under its ancestor mask, RoPE by depth."""
        if self.table.pending_len:
            raise RuntimeError("a draft tree is verified on its own: commit or roll back first")
        _install_tree_rope(model)
        depths = np.asarray(tree.depths(), dtype=np.int64)
        self.table.tree = (depths, tree.ancestor_mask().numpy())
        token = _TREE_SHIFTS.set(depths - np.arange(depths.size))
        try:
            yield
        finally:
            _TREE_SHIFTS.reset(token)
            self.table.tree = None

    def rollback(self, keep: int = 0) -> None:
        """Drop provisional entries (all, or all but the first ``keep``)."""
        self.table.drop_provisional(keep)
        self._sync_offsets()

    def reset(self) -> None:
        for layer in self.layers:
            layer.keys = layer.values = None
        self.table.reset()
        self._sync_offsets()

    def cached_positions(self) -> list[int]:
        pos = self.table.positions
        committed = pos[(pos >= 0) & ~np.isin(np.arange(pos.size), self.table.pending_slots)]
        return sorted(committed.tolist())

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


class MLXBackend(CacheBackend):
    """An mlx-lm causal LM over an :class:`MLXSinkWindowCache` (see :class:`kakeya_lab.backend.Backend`)."""

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

    def cached_positions(self) -> list[int]:
        return self.cache.cached_positions()


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
