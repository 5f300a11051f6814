"""The sink-window KV cache on torch (transformers v5 cache API).

Budget ``B = sink + window``: the first ``sink`` tokens plus the ``window`` most recent
committed tokens are held (docs/design.md, "The sink-window cache"). Storage is a pool of
slots per layer; a compact :class:`~kakeya_lab.backends.plan.SlotPlan` shared by the layers
says which absolute position each slot holds, where a block goes and which slots move on
eviction: committed entries occupy the dense prefix ``[0, used)``, a provisional block is
written after it (so it never overwrites a committed entry and can be dropped at any time,
also after the window has wrapped), and eviction happens only in
:meth:`SinkWindowCache.commit`, refilling freed slots with the newest committed entries.

Layer per behaviour, as in transformers: a :class:`SinkWindowLayer` stores its block's K/V,
adds the rolling-mode sink copies, moves slots on eviction and answers the
``CacheLayerMixin`` questions (``get_seq_length``, ``get_mask_sizes``, ...) from the plan.
The mask reaches the attention through ``get_mask_sizes`` (see
:mod:`kakeya_lab.backends.torch_attention`), so the model must use the
``"kakeya_sink_window"`` implementation (``load_model`` arranges it;
:func:`~kakeya_lab.backends.torch_attention.enable_sink_window_attention` otherwise).

Two ways to drive it:

* the :class:`~kakeya_lab.verifier.Verifier` sets ``auto_commit=False`` and calls
  :meth:`SinkWindowCache.commit` / :meth:`SinkWindowCache.rollback` itself;
* ``model.generate(cache=cache)`` (``past_key_values=`` before transformers 5.24) leaves ``auto_commit=True``: each forward's
  tokens are committed when the next forward starts (generation never rolls back).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.plan import Block, Moves, SlotPlan
from kakeya_lab.backends.seam import interrupts_deferred
from kakeya_lab.backends.torch_attention import LayoutMask, rotate
from kakeya_lab.models.dims import model_dims
from kakeya_lab.native.step import move_slots


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


@dataclass(frozen=True)
class TorchBlock:
    """A :class:`~kakeya_lab.backends.plan.Block` as torch indices on the cache's device:
    the block's ``slots`` (``span`` when contiguous), its regular key columns
    ``[0, columns)``, all columns ``[0, stop)``, and for rolling sink copies the source slot
    and RoPE shift of each copy column."""

    n: int
    span: tuple[int, int] | None
    slots: torch.Tensor
    columns: int
    stop: int
    copy_sources: torch.Tensor | None
    copy_shifts: torch.Tensor | None

    @classmethod
    def of(cls, block: Block, device: torch.device) -> TorchBlock:
        copies = block.layout.copies

        def index(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        return cls(
            n=block.slots.size,
            span=block.span,
            slots=index(block.slots),
            columns=block.columns,
            stop=block.stop,
            copy_sources=None if copies is None else index(copies.column_sources),
            copy_shifts=None if copies is None else index(copies.column_shifts),
        )


class SinkWindowLayer(CacheLayerMixin):
    """Slot storage of one layer: ``keys``/``values`` of shape ``[1, kv_heads, capacity, head_dim]``,
    slot meaning given by the shared :class:`~kakeya_lab.backends.plan.SlotPlan`."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, plan: SlotPlan, device: torch.device, inv_freq: torch.Tensor | None):
        super().__init__()
        self.plan = plan
        self.mask_device = device
        self.inv_freq = inv_freq

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
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        block: TorchBlock,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's K/V in its slots and return every key/value column of the forward
        (regular columns, then the rolling-mode sink copies)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._planned_storage()
        if block.span is not None:
            start, stop = block.span
            keys[:, :, start:stop] = key_states
            values[:, :, start:stop] = value_states
        else:
            keys[:, :, block.slots] = key_states
            values[:, :, block.slots] = value_states
        if block.copy_sources is not None and block.copy_shifts is not None:
            if self.inv_freq is None:  # the cache sets it whenever rolling positions evict
                raise RuntimeError("rolling sink copies need the model's rotary frequencies")
            sources = block.copy_sources
            keys[:, :, block.columns : block.stop] = rotate(
                keys[:, :, sources], block.copy_shifts, self.inv_freq
            )
            values[:, :, block.columns : block.stop] = values[:, :, sources]
        return keys[:, :, : block.stop], values[:, :, : block.stop]

    def move(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Eviction or a tree path: copy the entries in slots ``sources`` into ``destinations``."""
        if self.is_initialized:
            keys, values = self.storage()
            keys[:, :, destinations] = keys[:, :, sources]
            values[:, :, destinations] = values[:, :, sources]

    def live_bytes(self) -> int:
        """Bytes of this layer's committed K and V entries."""
        if not self.is_initialized:
            return 0
        used = self.plan.used
        keys, values = self.storage()
        return keys[:, :, :used].nbytes + values[:, :, :used].nbytes

    def span_slots(self, block: TorchBlock) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a caller that writes the block's K/V itself: the storage ``(keys, values)``
        (with room for the block) and the block's first slot, when the block is one run of
        slots with no rolling sink copies and the layer holds storage; else None (then
        :meth:`update` it)."""
        if block.span is None or block.copy_sources is not None or not self.is_initialized:
            return None
        keys, values = self._planned_storage()
        return keys, values, block.span[0]

    def _planned_storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The storage, resized first to the plan's capacity (keeping what it holds)."""
        held = self.storage()[0].shape[2]
        self.reserve(self.plan.capacity, min(held, self.plan.capacity))
        return self.storage()

    # transformers types the second item (kv_offset) as int; the layout rides in that slot.
    def get_mask_sizes(self, query_length: int) -> tuple[int, LayoutMask]:  # type: ignore[override]
        """``(key columns, layout)`` of the next forward: the layout rides in the ``kv_offset``
        slot to the ``"kakeya_sink_window"`` mask function
        (:mod:`kakeya_lab.backends.torch_attention`)."""
        layout = LayoutMask.of(self.plan.plan(query_length).layout, self.mask_device)
        return layout.num_columns, layout

    def get_seq_length(self) -> int:
        """Tokens seen so far (committed + provisional): the next token's position."""
        return self.plan.next_position

    def get_max_length(self) -> int:
        budget = self.plan.config.budget
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
        self.plan = SlotPlan(config, compact=True)
        if inv_freq is not None:
            inv_freq = inv_freq.to(self.device)
        super().__init__(
            layers=[SinkWindowLayer(self.plan, self.device, inv_freq) for _ in range(n_layers)]
        )
        self.auto_commit = auto_commit
        self._next_layer = 0
        self._block: TorchBlock | None = None
        self._opened = False  # open_block() ran and layer 0 is not written yet

    # ------------------------------------------------------------------ state
    @property
    def sink_window_layers(self) -> list[SinkWindowLayer]:
        """``layers``, typed: every layer of this cache is a :class:`SinkWindowLayer`."""
        return cast(list[SinkWindowLayer], self.layers)

    @property
    def history_len(self) -> int:
        return self.plan.history_len

    @property
    def pending_len(self) -> int:
        return self.plan.pending_len

    @property
    def cache_len(self) -> int:
        """Committed entries currently held."""
        return self.plan.used

    @property
    def next_position(self) -> int:
        """Absolute position of the next token fed to the model."""
        return self.plan.next_position

    def cached_positions(self) -> list[int]:
        """Absolute positions of the committed entries held, ascending."""
        return self.plan.cached_positions()

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
    ) -> tuple[int, LayoutMask]:
        """A forward starts: commit the previous one first when ``auto_commit``."""
        if (
            self.auto_commit
            and self.pending_len
            and self._next_layer in (0, len(self.layers))
            and not self._opened
        ):
            self.commit(self.pending_len)
        return self.sink_window_layers[layer_idx].get_mask_sizes(query_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's K/V after the committed entries and return every key column.

        Layer 0 opens the block (committing the previous one first when ``auto_commit``)
        unless :meth:`open_block` opened it; the other layers must follow in order.
        """
        if key_states.shape[0] != 1:
            raise ValueError("SinkWindowCache holds a single sequence (batch size 1)")
        n = key_states.shape[2]
        if layer_idx == 0 and not self._opened:
            self.open_block(n)
        if layer_idx != self._next_layer or self._block is None or n != self._block.n:
            raise RuntimeError(
                f"layer {layer_idx} updated out of order (expected {self._next_layer})"
            )
        self._opened = False
        self._next_layer = layer_idx + 1
        return self.sink_window_layers[layer_idx].update(key_states, value_states, self._block)

    def open_block(self, n: int) -> None:
        """Open the next forward's block of ``n`` tokens, as layer 0's :meth:`update` would
        (committing the previous block first when ``auto_commit``), for a caller that then
        writes layer 0 through :meth:`span_slots` (or :meth:`update`, which takes the open
        block). Until layer 0 is written the forward counts as begun: only
        :meth:`rollback` (or :meth:`crop`, :meth:`reset`) undoes it."""
        self._check_forward_complete()
        if self.auto_commit and self.pending_len:
            self.commit(self.pending_len)
        self._block = TorchBlock.of(self.plan.open(n), self.device)
        self._next_layer = 0
        self._opened = True

    def span_slots(
        self, layer_idx: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """Layer ``layer_idx`` of the open block of ``n`` tokens (layer 0 only after
        :meth:`open_block`), for a caller that writes the block's K/V into the storage
        itself and attends over it (the compiled batched attention): ``(keys, values,
        first slot, columns)``, the storage ``[1, kv_heads, capacity, head_dim]``, the block
        to go to slots ``first..first + n`` and the forward to see the first ``columns``.
        The layer counts as updated. None when the block is not one run of slots, has
        rolling sink copies, or the layer holds no storage yet: then :meth:`update` it."""
        block = self._block
        if (
            (layer_idx == 0 and not self._opened)
            or layer_idx != self._next_layer
            or block is None
            or n != block.n
        ):
            raise RuntimeError(
                f"layer {layer_idx} updated out of order (expected {self._next_layer})"
            )
        slots = self.sink_window_layers[layer_idx].span_slots(block)
        if slots is None:
            return None
        self._opened = False
        self._next_layer = layer_idx + 1
        return (*slots, block.stop)

    @torch.inference_mode()
    def copy_entries(self, source: SinkWindowCache, n: int, dtype: torch.dtype) -> bool:
        """Write the next ``n`` positions' keys and values as ``source`` holds them (a cache
        of a model with the same layer shapes and rotary embedding, for a draft model that
        is a copy of the verifier: the verifier's entries of a prompt instead of a forward of
        its own) as a provisional block, as a forward would leave it (then ``commit``, or
        ``rollback``). A position ``source`` no longer holds is left unwritten when this
        cache's commit of the block evicts it (a prompt longer than the window: only its
        sinks and last ``window`` entries matter). False, nothing changed, when ``source``
        lacks a position this cache would keep (it holds committed entries only) or its
        layers differ in shape. ``dtype``: this cache's model's, which its storage takes
        (converted from ``source``'s)."""
        start = self.next_position
        sizes = (len(self.layers), self.num_kv_heads, self.head_dim)
        if n < 1 or sizes != (len(source.layers), source.num_kv_heads, source.head_dim):
            return False
        held = source.plan.positions.copy()
        held[source.plan.pending_slots] = -1  # provisional there: not the source's to give
        slots = np.full(n, -1, dtype=np.int64)
        found = np.nonzero((held >= start) & (held < start + n))[0]
        slots[held[found] - start] = found
        lacking = start + np.nonzero(slots < 0)[0]
        window, sink = self.config.window, self.config.sink
        if lacking.size and (
            window is None or (lacking < sink).any() or (lacking >= start + n - window).any()
        ):
            return False  # this cache would keep one of them
        sources = source.sink_window_layers
        if not all(layer.is_initialized for layer in sources):
            return False
        self.open_block(n)
        block = self._block
        assert block is not None
        rows = np.nonzero(slots >= 0)[0]  # the block's rows source holds
        at = block.slots[torch.from_numpy(rows).to(self.device)]
        index = torch.from_numpy(slots[rows]).to(self.device)
        for mine, theirs in zip(self.sink_window_layers, sources):
            their_keys, their_values = theirs.storage()
            if not mine.is_initialized:
                mine.lazy_initialization(
                    their_keys[:, :, :0].to(dtype), their_values[:, :, :0].to(dtype)
                )
            keys, values = mine._planned_storage()
            keys[:, :, at] = their_keys[:, :, index].to(keys.dtype)
            values[:, :, at] = their_values[:, :, index].to(values.dtype)
        self._opened = False
        self._next_layer = len(self.layers)
        return True

    def _check_forward_complete(self) -> None:
        if self._opened or self._next_layer not in (0, len(self.layers)):
            raise RuntimeError(
                f"the last forward stopped at layer {self._next_layer}; only rollback() is possible"
            )

    def _move(self, moves: Moves | None) -> None:
        if moves is None:
            return
        sources = torch.from_numpy(moves.sources).to(self.device)
        destinations = torch.from_numpy(moves.destinations).to(self.device)
        held = [layer for layer in self.sink_window_layers if layer.is_initialized]
        storages = [t for layer in held for t in layer.storage()]
        if storages and move_slots(storages, sources, destinations):
            return  # every layer's moves in one compiled call
        for layer in held:
            layer.move(sources, destinations)

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
            self._move(self.plan.commit(n))
            capacity = self.plan.shrunk_capacity()
            if capacity is not None:
                for layer in self.sink_window_layers:
                    if layer.is_initialized:
                        layer.reserve(capacity, self.plan.used)
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
            self._move(self.plan.select(indices))

    @contextmanager
    def tree_forward(self, tree: Any) -> Iterator[torch.Tensor]:
        """Within the block, the next forward is the :class:`~kakeya_lab.tree.DraftTree`
        ``tree`` (queries at ``next_position + depth`` under its ancestor mask); yields the
        position ids to feed."""
        self.plan.set_tree(tree.depths(), tree.ancestor_mask().numpy())
        try:
            positions = self.plan.block_positions(len(tree))
            yield torch.from_numpy(positions).to(self.device)
        finally:
            self.plan.set_tree(None)

    @torch.inference_mode()
    def rollback(self) -> None:
        """Drop every provisional entry (also a forward that stopped midway); committed
        entries are untouched."""
        self.plan.drop_provisional(0)
        self._next_layer = 0
        self._opened = False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (committed + provisional): the next token's position."""
        return self.plan.next_position

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
        self._opened = False
        self.plan.drop_provisional(target - self.history_len)

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget everything (storage is released)."""
        for layer in self.layers:
            layer.reset()
        self.plan.reset()
        self._next_layer = 0
        self._opened = False

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
