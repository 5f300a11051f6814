"""The sink-window KV cache (transformers v5 cache API).

Budget ``B = sink + window``: the first ``sink`` tokens plus the ``window`` most recent
committed tokens are held (docs/design.md, "The sink-window cache"). Storage is a pool of slots
per layer; a :class:`SlotTable` shared by the layers says which absolute position each slot
holds. Committed entries occupy the dense prefix ``[0, used)``; a provisional block is
written after it, so it never overwrites a committed entry and can be dropped at any time,
also after the window has wrapped. Eviction happens only in :meth:`SinkWindowCache.commit`:
evicted slots are refilled by moving the newest committed entries into them (no full copy
per token).

Layer per behaviour, as in transformers: a :class:`SinkWindowLayer` stores its block's K/V,
adds the rolling-mode sink copies, moves slots on eviction and answers the
``CacheLayerMixin`` questions (``get_seq_length``, ``get_mask_sizes``, ...) from the table.
The mask reaches the attention through ``get_mask_sizes`` (see :mod:`kakeya_lab.attention`),
so the model must use the ``"kakeya_sink_window"`` implementation (``load_model`` arranges
it; :func:`kakeya_lab.attention.enable_sink_window_attention` otherwise).

Two ways to drive it:

* the :class:`~kakeya_lab.verifier.Verifier` sets ``auto_commit=False`` and calls
  :meth:`SinkWindowCache.commit` / :meth:`SinkWindowCache.rollback` itself;
* ``model.generate(cache=cache)`` (``past_key_values=`` before transformers 5.24) leaves ``auto_commit=True``: each forward's
  tokens are committed when the next forward starts (generation never rolls back).
"""

from __future__ import annotations

import inspect
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal, cast

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from kakeya_lab.attention import KeyLayout, SinkCopies, key_layout, rotate
from kakeya_lab.models.dims import model_dims

PositionMode = Literal["global", "rolling"]


@dataclass(frozen=True)
class SinkWindowConfig:
    """Cache semantics: ``sink`` first tokens + ``window`` most recent ones.

    ``window=None`` means a full cache that never evicts (the baseline arm).
    ``positions`` is ``"global"`` (keys keep their absolute RoPE position) or
    ``"rolling"`` (StreamingLLM: sinks sit just before the window).
    """

    sink: int = 4
    window: int | None = 1020
    positions: PositionMode = "global"

    def __post_init__(self) -> None:
        from kakeya_lab import inputs

        object.__setattr__(self, "sink", inputs.size(self.sink, "sink", minimum=0))
        if self.window is not None:
            hint = "it includes the current token; None never evicts"
            window = inputs.size(self.window, "window", minimum=1, hint=hint)
            object.__setattr__(self, "window", window)
        if self.positions not in ("global", "rolling"):
            raise ValueError(f"positions must be 'global' or 'rolling', got {self.positions!r}")

    @property
    def budget(self) -> int | None:
        """``B = sink + window`` entries held once full; ``None`` for a full cache."""
        return None if self.window is None else self.sink + self.window

    @property
    def evicts(self) -> bool:
        return self.window is not None

    def to_dict(self) -> dict:
        return {"sink": self.sink, "window": self.window, "positions": self.positions}


def cache_kwarg(model: Any, cache: Cache) -> dict[str, Cache]:
    """``cache`` as the keyword argument ``model``'s forward takes it under: ``cache`` from
    transformers 5.24 on (where ``past_key_values`` is deprecated, with a warning on every
    call), ``past_key_values`` before."""
    owner = type(model)
    keyword = _CACHE_KEYWORD.get(owner)
    if keyword is None:
        params = inspect.signature(model.forward).parameters
        keyword = _CACHE_KEYWORD[owner] = "cache" if "cache" in params else "past_key_values"
    return {keyword: cache}


_CACHE_KEYWORD: dict[type, str] = {}  # per model class (a forward call is the hot path)


def rope_inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """The rotary inverse frequencies of ``model`` (needed to re-rotate sink scores)."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return inv_freq.detach().float()
    raise ValueError(f"{type(model).__name__} has no rotary embedding: rolling positions need RoPE")


def analytic_kv_budget_bytes(model: Any, config: SinkWindowConfig) -> int | None:
    """``B × layers × kv_heads × head_dim × dtype_bytes × 2`` (None for a full cache), for a
    transformers model or an mlx-lm model (dtype of its weights)."""
    if config.budget is None:
        return None
    if not isinstance(model, torch.nn.Module):  # an mlx-lm model
        from kakeya_lab.mlx_backend import kv_bytes_per_token

        return config.budget * kv_bytes_per_token(model)
    dtype_bytes = next(model.parameters()).element_size()
    return config.budget * model_dims(model).kv_bytes_per_token(dtype_bytes)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a SIGINT (``KeyboardInterrupt``, a notebook's Stop button) until the block has
    run, then raise it. A no-op outside the main thread, where Python never delivers
    ``KeyboardInterrupt`` asynchronously."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, FrameType | None]] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(*received[0])
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


@dataclass(frozen=True)
class Block:
    """Where one forward's entries go: slots ``[start, stop)``; rolling-mode sink copies
    (if any) follow in scratch slots after ``stop``."""

    start: int
    stop: int
    copies: SinkCopies | None


class SlotTable:
    """Which absolute position each storage slot holds; shared by a cache's layers.

    Counters: ``history_len`` committed tokens so far; ``used`` committed entries held
    (slots ``[0, used)``); ``pending_len`` provisional entries (slots ``[used, used + pending_len)``).
    """

    SHRINK_SLACK = 2048  # reserved-but-unused slots tolerated before storage shrinks

    def __init__(
        self, config: SinkWindowConfig, device: torch.device, inv_freq: torch.Tensor | None
    ):
        self.config = config
        self.device = device
        self.inv_freq = inv_freq
        self.positions = torch.full((0,), -1, dtype=torch.long, device=device)
        self.used = 0
        self.pending_len = 0
        self.history_len = 0
        # the open forward's draft-tree shape (depth per query, ancestor mask), if any
        self.tree: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        return self.positions.numel()

    @property
    def next_position(self) -> int:
        """Absolute position of the next token fed to the model."""
        return self.history_len + self.pending_len

    def layout(self, query_length: int) -> KeyLayout:
        """The key layout of the next forward of ``query_length`` tokens (changes nothing);
        a draft tree's queries sit at ``next_position + depth`` under its ancestor mask."""
        ancestors = None
        if self.tree is not None:
            depths, ancestors = self.tree
            if depths.numel() != query_length:
                raise RuntimeError(
                    f"a draft tree of {depths.numel()} nodes but a forward of {query_length} tokens"
                )
            queries = self.next_position + depths.to(self.device)
        else:
            queries = torch.arange(
                self.next_position,
                self.next_position + query_length,
                dtype=torch.long,
                device=self.device,
            )
        keys = torch.cat([self.positions[: self.used + self.pending_len], queries])
        c = self.config
        return key_layout(
            keys, queries, c.sink, c.window, rolling=c.positions == "rolling", ancestors=ancestors
        )

    def open(self, query_length: int) -> Block:
        """Append ``query_length`` provisional positions; where the layers write them."""
        layout = self.layout(query_length)
        start = self.used + self.pending_len
        stop = start + query_length
        needed = stop + (layout.copies.num_columns if layout.copies is not None else 0)
        if needed > self.capacity:
            grown = torch.full(
                (max(needed, 2 * self.capacity, 16),), -1, dtype=torch.long, device=self.device
            )
            grown[:start] = self.positions[:start]
            self.positions = grown
        self.positions[start:stop] = layout.query_positions
        self.pending_len += query_length
        return Block(start, stop, layout.copies)

    def select(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Make provisional entries ``indices`` (ascending) the first ``len(indices)``
        provisional entries and drop the others; they must hold consecutive positions from
        ``history_len`` on (a draft tree's root-to-node path). Returns the slot moves
        ``(sources, destinations)`` the layers must make. ValueError, nothing changed, else."""
        k = len(indices)
        idx = torch.tensor(list(indices), dtype=torch.long, device=self.device)
        if k and (int(idx.min()) < 0 or int(idx.max()) >= self.pending_len):
            raise ValueError(
                f"provisional entries {list(indices)} outside 0..{self.pending_len - 1}"
            )
        sources = self.used + idx
        want = torch.arange(self.history_len, self.history_len + k, device=self.device)
        if not torch.equal(self.positions[sources], want):
            raise ValueError(
                f"provisional entries {list(indices)} are not a path of consecutive positions "
                f"from {self.history_len}"
            )
        destinations = self.used + torch.arange(k, dtype=torch.long, device=self.device)
        self.positions[self.used + k : self.used + self.pending_len] = -1
        self.positions[destinations] = want
        self.pending_len = k
        return sources, destinations

    def commit(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keep ``n`` provisional entries, drop the rest, evict; returns the slot moves
        ``(sources, destinations)`` the layers must make, or None."""
        start = self.used
        self.positions[start + n : start + self.pending_len] = -1
        self.pending_len = 0
        self.history_len += n
        self.used = start + n
        window = self.config.window
        if window is None:  # a full cache never evicts
            return None
        pos = self.positions[: self.used]
        keep = (pos < self.config.sink) | (pos >= self.history_len - window)
        kept = int(keep.sum())
        if kept == self.used:
            return None
        holes = torch.nonzero(~keep[:kept]).flatten()
        movers = torch.nonzero(keep[kept:]).flatten() + kept
        self.positions[holes] = self.positions[movers]
        self.positions[kept : self.used] = -1
        self.used = kept
        return movers, holes

    def shrunk_capacity(self) -> int | None:
        """A smaller capacity once far more slots are reserved than used (else None)."""
        if self.capacity - self.used <= self.SHRINK_SLACK:
            return None
        capacity = self.used + self.SHRINK_SLACK // 8
        self.positions = self.positions[:capacity].clone()
        return capacity

    def drop_provisional(self, keep: int = 0) -> None:
        """Keep the first ``keep`` provisional entries, forget the others."""
        self.positions[self.used + keep : self.used + self.pending_len] = -1
        self.pending_len = min(self.pending_len, keep)

    def reset(self) -> None:
        self.positions = torch.full((0,), -1, dtype=torch.long, device=self.device)
        self.used = self.pending_len = self.history_len = 0


class SinkWindowLayer(CacheLayerMixin):
    """Slot storage of one layer: ``keys``/``values`` of shape ``[1, kv_heads, capacity, head_dim]``,
    slot meaning given by the shared :class:`SlotTable`."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, table: SlotTable):
        super().__init__()
        self.table = table

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty((1, key_states.shape[1], 0, key_states.shape[-1]))
        self.values = value_states.new_empty((1, value_states.shape[1], 0, value_states.shape[-1]))
        self.is_initialized = True

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(keys, values)`` slot tensors; the layer must hold storage."""
        if self.keys is None or self.values is None:
            raise RuntimeError("this cache layer holds no storage yet (no forward has run)")
        return self.keys, self.values

    def reserve(self, capacity: int, keep: int) -> None:
        """Resize storage to ``capacity`` slots, keeping the first ``keep``."""
        keys, values = self.storage()
        if keys.shape[2] == capacity:
            return
        resized = []
        for old in (keys, values):
            new = old.new_empty((1, old.shape[1], capacity, old.shape[3]))
            new[:, :, :keep] = old[:, :, :keep]
            resized.append(new)
        self.keys, self.values = resized

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, block: Block, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's K/V in its slots and return every key/value column of the forward
        (committed, provisional, then the rolling-mode sink copies)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.reserve(self.table.capacity, block.start)
        keys, values = self.storage()
        keys[:, :, block.start : block.stop] = key_states
        values[:, :, block.start : block.stop] = value_states
        stop = block.stop
        if block.copies is not None:
            cols, shifts = block.copies.source_columns, block.copies.shifts
            s, m = cols.numel(), shifts.numel()
            inv_freq = self.table.inv_freq
            if inv_freq is None:  # the cache sets it whenever rolling positions evict
                raise RuntimeError("rolling sink copies need the model's rotary frequencies")
            sink_keys = keys[:, :, cols].repeat(1, 1, m, 1)
            keys[:, :, stop : stop + m * s] = rotate(
                sink_keys, shifts.repeat_interleave(s), inv_freq
            )
            values[:, :, stop : stop + m * s] = values[:, :, cols].repeat(1, 1, m, 1)
            stop += m * s
        return keys[:, :, :stop], values[:, :, :stop]

    def move(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Eviction: copy the entries in slots ``sources`` into slots ``destinations``."""
        if self.is_initialized:
            keys, values = self.storage()
            keys[:, :, destinations] = keys[:, :, sources]
            values[:, :, destinations] = values[:, :, sources]

    def live_bytes(self) -> int:
        """Bytes of this layer's committed K and V entries."""
        if not self.is_initialized:
            return 0
        used = self.table.used
        keys, values = self.storage()
        return keys[:, :, :used].nbytes + values[:, :, :used].nbytes

    # transformers types the second item (kv_offset) as int; the layout rides in that slot.
    def get_mask_sizes(self, query_length: int) -> tuple[int, KeyLayout]:  # type: ignore[override]
        """``(key columns, layout)`` of the next forward: the layout rides in the ``kv_offset``
        slot to the ``"kakeya_sink_window"`` mask function (:mod:`kakeya_lab.attention`)."""
        layout = self.table.layout(query_length)
        return layout.num_columns, layout

    def get_seq_length(self) -> int:
        """Tokens seen so far (committed + provisional): the next token's position."""
        return self.table.next_position

    def get_max_length(self) -> int:
        budget = self.table.config.budget
        return -1 if budget is None else budget

    def reset(self) -> None:
        """Release the storage."""
        self.keys = self.values = None
        self.is_initialized = False


class SinkWindowCache(Cache):
    """A rewindable sink-window KV cache for one sequence (batch size 1).

    Counters: ``history_len`` committed tokens so far; ``cache_len`` committed entries
    held (``<= sink + window``); ``pending_len`` provisional entries of the current block.
    """

    def __init__(
        self, model: PreTrainedModel, config: SinkWindowConfig, *, auto_commit: bool = True
    ):
        self.config = config
        self.dims = model_dims(model)
        n_layers, self.num_kv_heads, self.head_dim = (
            self.dims.num_layers,
            self.dims.num_kv_heads,
            self.dims.head_dim,
        )
        inv_freq = None
        if config.positions == "rolling" and config.evicts:
            inv_freq = rope_inv_freq(model)
            if 2 * inv_freq.numel() != self.head_dim:
                raise ValueError(
                    "rolling positions need full-width rotary embeddings (partial RoPE is not supported)"
                )
        self.device = next(model.parameters()).device
        self.table = SlotTable(
            config, self.device, None if inv_freq is None else inv_freq.to(self.device)
        )
        super().__init__(layers=[SinkWindowLayer(self.table) for _ in range(n_layers)])
        self.auto_commit = auto_commit
        self._next_layer = 0
        self._block: Block | None = None

    # ------------------------------------------------------------------ state
    @property
    def sink_window_layers(self) -> list[SinkWindowLayer]:
        """``layers``, typed: every layer of this cache is a :class:`SinkWindowLayer`."""
        return cast(list[SinkWindowLayer], self.layers)

    @property
    def history_len(self) -> int:
        return self.table.history_len

    @property
    def pending_len(self) -> int:
        return self.table.pending_len

    @property
    def cache_len(self) -> int:
        """Committed entries currently held."""
        return self.table.used

    @property
    def next_position(self) -> int:
        """Absolute position of the next token fed to the model."""
        return self.table.next_position

    def cached_positions(self) -> torch.Tensor:
        """Absolute positions of the committed entries held, ascending."""
        return torch.sort(self.table.positions[: self.table.used]).values

    def kv_live_bytes(self) -> int:
        """Bytes of the committed K and V entries held, summed over layers (from the tensors)."""
        return sum(layer.live_bytes() for layer in self.sink_window_layers)

    def kv_budget_bytes(self, dtype_bytes: int | None = None) -> int | None:
        """The analytic budget ``B × layers × kv_heads × head_dim × dtype_bytes × 2``."""
        if self.config.budget is None:
            return None
        if dtype_bytes is None:
            first = self.sink_window_layers[0]
            if not first.is_initialized:
                return None
            dtype_bytes = first.storage()[0].element_size()
        return self.config.budget * self.dims.kv_bytes_per_token(dtype_bytes)

    # --------------------------------------------------------- Cache interface
    # transformers types the second item (kv_offset) as int; the layout rides in that slot.
    def get_mask_sizes(  # type: ignore[override]
        self, query_length: int, layer_idx: int = 0
    ) -> tuple[int, KeyLayout]:
        """A forward starts: commit the previous one first when ``auto_commit``."""
        if self.auto_commit and self.pending_len and self._next_layer in (0, len(self.layers)):
            self.commit(self.pending_len)
        return self.sink_window_layers[layer_idx].get_mask_sizes(query_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's K/V after the committed entries and return every key column.

        Layer 0 opens the block (committing the previous one first when ``auto_commit``);
        the other layers must follow in order.
        """
        if key_states.shape[0] != 1:
            raise ValueError("SinkWindowCache holds a single sequence (batch size 1)")
        n = key_states.shape[2]
        if layer_idx == 0:
            self._check_forward_complete()
            if self.auto_commit and self.pending_len:
                self.commit(self.pending_len)
            self._block = self.table.open(n)
        elif (
            layer_idx != self._next_layer
            or self._block is None
            or n != self._block.stop - self._block.start
        ):
            raise RuntimeError(
                f"layer {layer_idx} updated out of order (expected {self._next_layer})"
            )
        self._next_layer = layer_idx + 1
        return self.sink_window_layers[layer_idx].update(key_states, value_states, self._block)

    def _check_forward_complete(self) -> None:
        if self._next_layer not in (0, len(self.layers)):
            raise RuntimeError(
                f"the last forward stopped at layer {self._next_layer}; only rollback() is possible"
            )

    @torch.inference_mode()
    def commit(self, n: int) -> None:
        """Keep the first ``n`` provisional entries, drop the rest, then evict.

        Eviction keeps the sinks and the ``window`` most recent committed tokens; freed
        slots are refilled from the end of the committed prefix. The whole step runs with
        SIGINT held, so an interrupt cannot leave the layers half-moved.
        """
        if not 0 <= n <= self.pending_len:
            raise ValueError(f"commit({n}) with {self.pending_len} provisional entries")
        self._check_forward_complete()
        with interrupts_deferred():
            moves = self.table.commit(n)
            if moves is not None:
                for layer in self.sink_window_layers:
                    layer.move(*moves)
            capacity = self.table.shrunk_capacity()
            if capacity is not None:
                for layer in self.sink_window_layers:
                    if layer.is_initialized:
                        layer.reserve(capacity, self.table.used)
            self._next_layer = 0

    @torch.inference_mode()
    def select(self, indices: Sequence[int]) -> None:
        """Keep provisional entries ``indices`` (a draft tree's root-to-node path, block
        indices ascending) as the first ``len(indices)`` provisional entries, dropping the
        rest: their K/V move into the slots a prefix would have used (keys were rotated at
        their path position, so nothing is re-rotated). Then ``commit(len(indices))``
        commits the path. Nothing is evicted here; ValueError, nothing changed, if
        ``indices`` is not such a path."""
        self._check_forward_complete()
        with interrupts_deferred():
            sources, destinations = self.table.select(indices)
            if not torch.equal(sources, destinations):
                for layer in self.sink_window_layers:
                    layer.move(sources, destinations)

    @contextmanager
    def tree_forward(self, tree: Any) -> Iterator[torch.Tensor]:
        """Within the block, the next forward is the :class:`~kakeya_lab.tree.DraftTree`
        ``tree`` (queries at ``next_position + depth`` under its ancestor mask); yields the
        position ids to feed."""
        if self.pending_len:
            raise RuntimeError("a draft tree is verified on its own: commit or roll back first")
        depths = torch.tensor(tree.depths(), dtype=torch.long, device=self.table.device)
        self.table.tree = (depths, tree.ancestor_mask().to(self.table.device))
        try:
            yield self.next_position + depths
        finally:
            self.table.tree = None

    @torch.inference_mode()
    def rollback(self) -> None:
        """Drop every provisional entry (also a forward that stopped midway); committed
        entries are untouched."""
        self.table.drop_provisional(0)
        self._next_layer = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (committed + provisional): the next token's position."""
        return self.table.next_position

    @torch.inference_mode()
    def crop(self, max_length: int) -> None:
        """Shorten to ``max_length`` tokens (negative: remove that many); provisional only."""
        target = self.next_position + max_length if max_length < 0 else max_length
        if target < self.history_len:
            raise ValueError(
                f"cannot crop to {target} tokens: {self.history_len} are committed (only the "
                "provisional block can be dropped)"
            )
        self._next_layer = 0
        self.table.drop_provisional(target - self.history_len)

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget everything (storage is released)."""
        for layer in self.layers:
            layer.reset()
        self.table.reset()
        self._next_layer = 0

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "SinkWindowCache holds one sequence; beam search is not supported"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("SinkWindowCache holds one sequence (num_return_sequences=1)")

    def __repr__(self) -> str:
        c = self.config
        return (
            f"SinkWindowCache(sink={c.sink}, window={c.window}, positions={c.positions!r}, "
            f"history_len={self.history_len}, cache_len={self.cache_len}, pending_len={self.pending_len})"
        )
