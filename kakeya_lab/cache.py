"""The sink-window KV cache (transformers v5 cache API).

Budget ``B = sink + window``: the first ``sink`` tokens plus the ``window`` most recent
committed tokens are held (DESIGN.md "Sink-window cache"). Storage is a pool of slots per
layer; ``slot_positions`` says which absolute position each slot holds. Committed
entries occupy the dense prefix ``[0, used)``; a provisional block is written after it, so
it never overwrites a committed entry and can be dropped at any time, also after the window
has wrapped. Eviction happens only in :meth:`SinkWindowCache.commit`: evicted slots are
refilled by moving the newest committed entries into them (no full copy per token).

Two ways to drive it:

* the :class:`~kakeya_lab.verifier.Verifier` sets ``auto_commit=False`` and calls
  :meth:`commit` / :meth:`rollback` itself;
* ``model.generate(past_key_values=cache)`` leaves ``auto_commit=True``: each forward's
  tokens are committed when the next forward starts (generation never rolls back).

Visibility is applied by :mod:`kakeya_lab.attention` from the positions published here, so
the model must use the ``"kakeya_sink_window"`` attention (``load_model`` arranges it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from kakeya_lab import attention

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


def rope_inv_freq(model: PreTrainedModel) -> torch.Tensor:
    """The rotary inverse frequencies of ``model`` (needed to re-rotate sink scores)."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            return inv_freq.detach().float()
    raise ValueError(f"{type(model).__name__} has no rotary embedding: rolling positions need RoPE")


def _model_dims(model: PreTrainedModel) -> tuple[int, int, int]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers = cfg.num_hidden_layers
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return n_layers, n_kv, head_dim


def analytic_kv_budget_bytes(model: PreTrainedModel, config: SinkWindowConfig) -> int | None:
    """``B × layers × kv_heads × head_dim × dtype_bytes × 2`` (None for a full cache)."""
    if config.budget is None:
        return None
    n_layers, n_kv, head_dim = _model_dims(model)
    dtype_bytes = next(model.parameters()).element_size()
    return config.budget * n_layers * n_kv * head_dim * dtype_bytes * 2


class SinkWindowLayer(CacheLayerMixin):
    """Slot storage of one layer: ``keys``/``values`` of shape ``[1, kv_heads, capacity, head_dim]``."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (1, key_states.shape[1], 0, key_states.shape[-1])
        self.keys = torch.empty(shape, dtype=key_states.dtype, device=self.device)
        self.values = torch.empty(
            (1, value_states.shape[1], 0, value_states.shape[-1]),
            dtype=value_states.dtype,
            device=self.device,
        )
        self.is_initialized = True

    def reserve(self, capacity: int, keep: int) -> None:
        """Resize storage to ``capacity`` slots, keeping the first ``keep``."""
        if self.keys.shape[2] == capacity:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty((1, old.shape[1], capacity, old.shape[3]))
            new[:, :, :keep] = old[:, :, :keep]
            setattr(self, name, new)

    def write(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        end = start + key_states.shape[2]
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.keys[:, :, dst] = self.keys[:, :, src]
        self.values[:, :, dst] = self.values[:, :, src]

    def live_bytes(self, used: int) -> int:
        if not self.is_initialized:
            return 0
        return self.keys[:, :, :used].nbytes + self.values[:, :, :used].nbytes

    def reserved_bytes(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes

    # The CacheLayerMixin interface; the owning SinkWindowCache answers these.
    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - not used
        raise RuntimeError("SinkWindowLayer is updated through SinkWindowCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:  # pragma: no cover
        raise RuntimeError("SinkWindowLayer is sized through SinkWindowCache")

    def get_seq_length(self) -> int:  # pragma: no cover
        raise RuntimeError("SinkWindowLayer is sized through SinkWindowCache")

    def get_max_length(self) -> int:
        return -1


class SinkWindowCache(Cache):
    """A rewindable sink-window KV cache for one sequence (batch size 1).

    Counters: ``history_len`` committed tokens so far; ``cache_len`` committed entries
    held (``<= sink + window``); ``pending_len`` provisional entries of the current block.
    """

    SHRINK_SLACK = 2048  # reserved-but-unused slots tolerated before storage shrinks

    def __init__(self, model: PreTrainedModel, config: SinkWindowConfig, *, auto_commit: bool = True):
        self.config = config
        n_layers, self.num_kv_heads, self.head_dim = _model_dims(model)
        super().__init__(layers=[SinkWindowLayer() for _ in range(n_layers)])
        self.auto_commit = auto_commit
        self.inv_freq = None
        if config.positions == "rolling" and config.evicts:
            self.inv_freq = rope_inv_freq(model)
            if 2 * self.inv_freq.numel() != self.head_dim:
                raise ValueError(
                    "rolling positions need full-width rotary embeddings (partial RoPE is not supported)"
                )
        param = next(model.parameters())
        self.device = param.device
        self.slot_positions = torch.full((0,), -1, dtype=torch.long, device=self.device)
        self.used = 0
        self.pending_len = 0
        self.history_len = 0
        self._block_start = 0
        self._block_positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._visible: torch.Tensor | None = None
        self._sink_shift: torch.Tensor | None = None
        self._next_layer = 0

    # ------------------------------------------------------------------ state
    @property
    def cache_len(self) -> int:
        """Committed entries currently held."""
        return self.used

    @property
    def next_position(self) -> int:
        """Absolute position of the next token fed to the model."""
        return self.history_len + self.pending_len

    def cached_positions(self) -> torch.Tensor:
        """Absolute positions of the committed entries held, ascending."""
        return torch.sort(self.slot_positions[: self.used]).values

    def kv_live_bytes(self) -> int:
        """Bytes of the committed K and V entries held, summed over layers (from the tensors)."""
        return sum(layer.live_bytes(self.used) for layer in self.layers)

    def kv_reserved_bytes(self) -> int:
        """Bytes allocated for K/V storage, including room for a provisional block."""
        return sum(layer.reserved_bytes() for layer in self.layers)

    def kv_budget_bytes(self, dtype_bytes: int | None = None) -> int | None:
        """The analytic budget ``B × layers × kv_heads × head_dim × dtype_bytes × 2``."""
        if self.config.budget is None:
            return None
        if dtype_bytes is None:
            first = self.layers[0]
            if not first.is_initialized:
                return None
            dtype_bytes = first.keys.element_size()
        return self.config.budget * len(self.layers) * self.num_kv_heads * self.head_dim * dtype_bytes * 2

    # --------------------------------------------------------- Cache interface
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's K/V after the committed entries and return every key column.

        Layer 0 opens a forward (committing the previous one first when ``auto_commit``);
        the other layers must follow in order.
        """
        if key_states.shape[0] != 1:
            raise ValueError("SinkWindowCache holds a single sequence (batch size 1)")
        n = key_states.shape[2]
        if layer_idx == 0:
            if self._next_layer not in (0, len(self.layers)):
                raise RuntimeError(
                    f"a forward stopped at layer {self._next_layer}; call rollback() before reusing the cache"
                )
            self._open_block(n)
        elif layer_idx != self._next_layer or n != self._block_positions.numel():
            raise RuntimeError(f"layer {layer_idx} updated out of order (expected {self._next_layer})")
        self._next_layer = layer_idx + 1
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        layer.reserve(self.slot_positions.numel(), self._block_start)
        layer.write(self._block_start, key_states, value_states)
        end = self.used + self.pending_len
        attention.publish(
            attention.KeyLayout(
                layer_idx=layer_idx,
                key_positions=self.slot_positions[:end],
                query_positions=self._block_positions,
                sink=self.config.sink,
                window=self.config.window,
                visible=self._visible,
                sink_query_shift=self._sink_shift,
                inv_freq=self.inv_freq,
            )
        )
        return layer.keys[:, :, :end], layer.values[:, :, :end]

    def _open_block(self, n: int) -> None:
        if self.auto_commit and self.pending_len:
            self.commit(self.pending_len)
        start = self.used + self.pending_len
        positions = torch.arange(
            self.next_position, self.next_position + n, dtype=torch.long, device=self.device
        )
        needed = start + n
        if needed > self.slot_positions.numel():
            capacity = max(needed, 2 * self.slot_positions.numel(), 16)
            grown = torch.full((capacity,), -1, dtype=torch.long, device=self.device)
            grown[:start] = self.slot_positions[:start]
            self.slot_positions = grown
        self.slot_positions[start:needed] = positions
        self._block_start = start
        self._block_positions = positions
        self.pending_len += n
        key_positions = self.slot_positions[:needed]
        self._visible = attention.visibility(
            positions, key_positions, self.config.sink, self.config.window
        )
        self._sink_shift = None
        if self.inv_freq is not None:
            last = self.config.budget - 1
            self._sink_shift = torch.clamp(last - positions, max=0)

    @torch.inference_mode()
    def commit(self, n: int) -> None:
        """Keep the first ``n`` provisional entries, drop the rest, then evict.

        Eviction keeps the sinks and the ``window`` most recent committed tokens; freed
        slots are refilled from the end of the committed prefix.
        """
        if not 0 <= n <= self.pending_len:
            raise ValueError(f"commit({n}) with {self.pending_len} provisional entries")
        self._check_forward_complete()
        start = self.used
        self.slot_positions[start + n : start + self.pending_len] = -1
        self.pending_len = 0
        self.history_len += n
        self.used = start + n
        if self.config.evicts:
            self._evict()
        self._maybe_shrink()

    @torch.inference_mode()
    def rollback(self) -> None:
        """Drop every provisional entry; committed entries are untouched."""
        self.slot_positions[self.used : self.used + self.pending_len] = -1
        self.pending_len = 0
        self._next_layer = 0
        attention.discard()

    def _evict(self) -> None:
        pos = self.slot_positions[: self.used]
        keep = (pos < self.config.sink) | (pos >= self.history_len - self.config.window)
        kept = int(keep.sum())
        if kept == self.used:
            return
        holes = torch.nonzero(~keep[:kept]).flatten()
        movers = torch.nonzero(keep[kept:]).flatten() + kept
        if holes.numel():
            for layer in self.layers:
                if layer.is_initialized:
                    layer.move(movers, holes)
            self.slot_positions[holes] = self.slot_positions[movers]
        self.slot_positions[kept : self.used] = -1
        self.used = kept

    def _maybe_shrink(self) -> None:
        capacity = self.slot_positions.numel()
        if capacity - self.used <= self.SHRINK_SLACK:
            return
        new_capacity = self.used + self.SHRINK_SLACK // 8
        self.slot_positions = self.slot_positions[:new_capacity].clone()
        for layer in self.layers:
            if layer.is_initialized:
                layer.reserve(new_capacity, self.used)

    def _check_forward_complete(self) -> None:
        if self._next_layer not in (0, len(self.layers)):
            raise RuntimeError(
                f"the last forward stopped at layer {self._next_layer}; only rollback() is possible"
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far (committed + provisional): the next token's position."""
        return self.next_position

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.used + self.pending_len + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.config.budget is None else self.config.budget

    @torch.inference_mode()
    def crop(self, max_length: int) -> None:
        """Shorten to ``max_length`` tokens (negative: remove that many); provisional only."""
        target = self.next_position + max_length if max_length < 0 else max_length
        if target < self.history_len:
            raise ValueError(
                f"cannot crop to {target} tokens: {self.history_len} are committed (only the "
                "provisional block can be dropped)"
            )
        keep = target - self.history_len
        self._next_layer = 0
        attention.discard()
        if keep < self.pending_len:
            self.slot_positions[self.used + keep : self.used + self.pending_len] = -1
            self.pending_len = keep

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget everything (storage is released)."""
        for layer in self.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
        self.slot_positions = torch.full((0,), -1, dtype=torch.long, device=self.device)
        self.used = self.pending_len = self.history_len = 0
        self._next_layer = 0

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("SinkWindowCache holds one sequence; beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("SinkWindowCache holds one sequence (num_return_sequences=1)")

    def __repr__(self) -> str:
        c = self.config
        return (
            f"SinkWindowCache(sink={c.sink}, window={c.window}, positions={c.positions!r}, "
            f"history_len={self.history_len}, cache_len={self.cache_len}, pending_len={self.pending_len})"
        )
