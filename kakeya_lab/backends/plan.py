"""The slot plan: where a sink-window cache's entries live, computed once for every backend.

Pure numpy; no tensor runtime. A backend stores keys and values in a pool of *slots* per
layer and does only tensor work (write a block into :attr:`Block.slots`, gather and rotate
the sink copies, apply :class:`Moves`) on what a :class:`SlotPlan` decides:

* which absolute position each slot holds (``-1``: free), shared by the layers of a cache;
* where a block of ``n`` new tokens goes (the lowest free slots), at which positions
  (consecutive from ``next_position``, or ``next_position + depth`` for a draft tree);
* the key layout of that forward (:func:`key_layout`): the position of every key column,
  the visibility rule as a boolean mask, the tree's ancestor mask on the block's own
  columns, and the rolling-mode sink copies with their RoPE shifts (:class:`SinkCopies`);
* eviction on commit (sinks + the ``window`` most recent committed tokens are kept), and,
  for a *compact* plan, the slot moves that refill the holes from the end so committed
  entries stay a dense prefix (torch: cheap in-place copies, and storage can shrink);
  a non-compact plan only frees slots (MLX: a move would copy whole arrays);
* the root-to-node path of a draft tree kept by :meth:`SlotPlan.select` (moved to the
  prefix slots when compact, relabelled otherwise).

Storage rule (docs/design.md, "The sink-window cache"): a provisional block never takes a
committed entry's slot, so it can be dropped at any time, also after the window wrapped.

Visibility (the oracle's rule, :mod:`kakeya_lab.reference`)::

    query at p sees key j  iff  0 <= j <= p  and  (j < sink  or  p - j < window)

``rolling`` positions: each query at ``p > sink + window - 1`` must see sink ``j`` at the
StreamingLLM distance ``sink + window - 1 - j`` while window keys keep their true distance.
One rotation of the cached keys cannot serve several queries, so the forward gets
*per-query copies* of the sink keys, rotated forward by ``p - (sink + window - 1)``, as
extra key columns after the regular ones (in scratch slots, never counted as live); the
mask lets query ``p`` see only its own copies and hides the original sink columns from it.
Exact in one forward; cost: ``sink`` extra key columns per such query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kakeya_lab.backends.config import SinkWindowConfig


@dataclass(frozen=True)
class SinkCopies:
    """Rolling mode: per-query rotated copies of the sink keys, appended as key columns.

    ``source_columns`` ``[s]``: the key columns holding the sinks; ``shifts`` ``[m]``: for
    each query that needs copies, by how many positions its ``s`` copies are rotated
    forward. The copies occupy ``m * s`` columns after the regular ones, query-major.
    """

    source_columns: np.ndarray
    shifts: np.ndarray

    @property
    def num_columns(self) -> int:
        return self.source_columns.size * self.shifts.size

    @property
    def column_sources(self) -> np.ndarray:
        """``[m * s]``: the source column of each copy column."""
        return np.tile(self.source_columns, self.shifts.size)

    @property
    def column_shifts(self) -> np.ndarray:
        """``[m * s]``: the RoPE shift of each copy column."""
        return np.repeat(self.shifts, self.source_columns.size)


@dataclass(frozen=True)
class KeyLayout:
    """The key columns of one forward, in positions.

    ``key_positions[c]``: absolute position held by regular key column ``c`` (``-1``:
    empty); ``query_positions``: the new tokens' positions; ``visible``: ``[queries,
    columns]`` bool (regular columns, then the rolling-mode sink copies, if any).
    """

    key_positions: np.ndarray
    query_positions: np.ndarray
    visible: np.ndarray
    copies: SinkCopies | None

    @property
    def num_columns(self) -> int:
        """Key columns of the forward, the sink copies included."""
        return int(self.visible.shape[1])


def visibility(
    query_positions: np.ndarray, key_positions: np.ndarray, sink: int, window: int | None
) -> np.ndarray:
    """The oracle mask ``[q, k]`` (True = attend) from absolute positions."""
    q = np.asarray(query_positions)[:, None]
    k = np.asarray(key_positions)[None, :]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= (k < sink) | (q - k < window)
    return visible


def key_layout(
    key_positions: np.ndarray,
    query_positions: np.ndarray,
    config: SinkWindowConfig,
    block_columns: np.ndarray | None = None,
    ancestors: np.ndarray | None = None,
) -> KeyLayout:
    """The layout of a forward whose regular key columns hold ``key_positions``.

    ``ancestors`` (a draft tree's ``[q, q]`` mask,
    :meth:`kakeya_lab.tree.DraftTree.ancestor_mask`) restricts the block's own columns
    ``block_columns`` (in block order) on top of the visibility rule: a node sees only its
    own path there. Rolling positions add the sink copies (module docstring).
    """
    sink, window = config.sink, config.window
    visible = visibility(query_positions, key_positions, sink, window)
    if ancestors is not None:
        if block_columns is None:
            raise ValueError("an ancestor mask needs the block's columns")
        visible[:, block_columns] &= ancestors
    copies = None
    if config.positions == "rolling" and window is not None:
        shift = np.maximum(query_positions - (sink + window - 1), 0)
        rows = np.nonzero(shift > 0)[0]
        cols = np.nonzero((key_positions >= 0) & (key_positions < sink))[0]
        if rows.size and cols.size:
            s, m = cols.size, rows.size
            copy_visible = np.zeros((query_positions.size, m * s), dtype=bool)
            copy_visible[np.repeat(rows, s), np.arange(m * s)] = visible[np.ix_(rows, cols)].ravel()
            visible[np.ix_(rows, cols)] = False
            visible = np.concatenate([visible, copy_visible], axis=1)
            copies = SinkCopies(source_columns=cols, shifts=shift[rows])
    return KeyLayout(key_positions, query_positions, visible, copies)


@dataclass(frozen=True)
class Block:
    """Where one forward's entries go: ``slots`` (in block order; contiguous unless a
    non-compact plan fills holes), ``layout`` of the forward (its regular key columns are
    slots ``[0, columns)``); the rolling-mode sink copies, if any, go to the scratch slots
    ``[columns, columns + copies.num_columns)``."""

    slots: np.ndarray
    columns: int
    layout: KeyLayout

    @property
    def span(self) -> tuple[int, int] | None:
        """``(start, stop)`` when the slots are contiguous (a slice write), else None."""
        n = self.slots.size
        start = int(self.slots[0])
        return (start, start + n) if int(self.slots[-1]) - start == n - 1 else None

    @property
    def stop(self) -> int:
        """Slots ``[0, stop)`` hold every key column of this forward, sink copies included."""
        return self.layout.num_columns


@dataclass(frozen=True)
class Moves:
    """Slot copies a layer makes: the entry in ``sources[i]`` goes to ``destinations[i]``
    (all read before any is written)."""

    sources: np.ndarray
    destinations: np.ndarray


class SlotPlan:
    """Which absolute position each slot holds, and every decision about slots (module doc).

    Counters: ``history_len`` committed tokens so far; ``used`` committed entries held;
    ``pending_slots`` the provisional entries' slots in block order. With ``compact`` the
    committed entries are always slots ``[0, used)`` and a block goes right after the
    provisional ones.
    """

    SHRINK_SLACK = 2048  # compact: reserved-but-unused slots tolerated before storage shrinks

    def __init__(self, config: SinkWindowConfig, *, compact: bool):
        self.config = config
        self.compact = compact
        self.reset()

    def reset(self) -> None:
        """Forget everything."""
        self.positions = np.full(0, -1, dtype=np.int64)
        self.used = self.history_len = 0
        self.pending_slots = np.zeros(0, dtype=np.int64)
        # the open forward's draft-tree shape (depth per query, ancestor mask), if any
        self.tree: tuple[np.ndarray, np.ndarray] | None = None
        self._memo: tuple[tuple[int, int], Block] | None = None
        self._version = 0

    def _changed(self) -> None:
        self._version += 1

    @property
    def capacity(self) -> int:
        return self.positions.size

    @property
    def pending_len(self) -> int:
        return self.pending_slots.size

    @property
    def next_position(self) -> int:
        """Absolute position of the next token fed to the model."""
        return self.history_len + self.pending_len

    def set_tree(self, depths: Sequence[int] | None, ancestors: np.ndarray | None = None) -> None:
        """The next forward is a draft tree (``depths`` per node, ``[n, n]`` ancestor mask);
        ``None`` ends it."""
        if depths is None or ancestors is None:
            self.tree = None
        else:
            if self.pending_len:
                raise RuntimeError("a draft tree is verified on its own: commit or roll back first")
            self.tree = (np.asarray(depths, dtype=np.int64), np.asarray(ancestors, dtype=bool))
        self._changed()

    def block_positions(self, n: int) -> np.ndarray:
        """Positions of the next ``n`` entries: consecutive, or by depth for a tree."""
        if self.tree is not None:
            depths = self.tree[0]
            if depths.size != n:
                raise RuntimeError(
                    f"a draft tree of {depths.size} nodes but a forward of {n} tokens"
                )
            return self.next_position + depths
        return np.arange(self.next_position, self.next_position + n, dtype=np.int64)

    def tree_rope_shifts(self) -> np.ndarray | None:
        """For a tree forward: by how much each node's RoPE must move on from consecutive
        positions to its depth (``depth - index``); None outside a tree forward."""
        if self.tree is None:
            return None
        depths = self.tree[0]
        return depths - np.arange(depths.size)

    def plan(self, n: int) -> Block:
        """Where the next forward of ``n`` tokens goes and its key layout (changes nothing)."""
        key = (n, self._version)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        if n < 1:
            raise ValueError(f"a forward of {n} tokens")
        free = np.nonzero(self.positions == -1)[0][:n]
        if free.size < n:
            free = np.concatenate(
                [free, np.arange(self.capacity, self.capacity + n - free.size, dtype=np.int64)]
            )
        occupied = np.nonzero(self.positions >= 0)[0]
        columns = int(max(free.max(), occupied.max() if occupied.size else -1)) + 1
        keys = np.full(columns, -1, dtype=np.int64)
        held = min(columns, self.capacity)
        keys[:held] = self.positions[:held]
        queries = self.block_positions(n)
        keys[free] = queries
        ancestors = self.tree[1] if self.tree is not None else None
        layout = key_layout(keys, queries, self.config, free, ancestors)
        block = Block(free, columns, layout)
        self._memo = (key, block)
        return block

    def open(self, n: int) -> Block:
        """Append ``n`` provisional entries (growing the slot count if needed); where the
        layers write them."""
        block = self.plan(n)
        if block.stop > self.capacity:
            grown = np.full(max(block.stop, 2 * self.capacity, 16), -1, dtype=np.int64)
            grown[: self.capacity] = self.positions
            self.positions = grown
        self.positions[block.slots] = block.layout.query_positions
        self.pending_slots = np.concatenate([self.pending_slots, block.slots])
        self._changed()
        return block

    def commit(self, n: int) -> Moves | None:
        """Keep the first ``n`` provisional entries, drop the rest, evict; the moves a
        compact plan's layers must make (None: none)."""
        if not 0 <= n <= self.pending_len:
            raise ValueError(f"commit({n}) with {self.pending_len} provisional entries")
        self.positions[self.pending_slots[n:]] = -1
        self.pending_slots = np.zeros(0, dtype=np.int64)
        self.history_len += n
        self._changed()
        window = self.config.window
        pos = self.positions
        if window is not None:  # a full cache never evicts
            pos[(pos >= self.config.sink) & (pos < self.history_len - window)] = -1
        self.used = int((pos >= 0).sum())
        if not self.compact:
            return None
        holes = np.nonzero(pos[: self.used] < 0)[0]
        if not holes.size:
            return None
        movers = np.nonzero(pos[self.used :] >= 0)[0] + self.used
        pos[holes] = pos[movers]
        pos[movers] = -1
        return Moves(movers, holes)

    def shrunk_capacity(self) -> int | None:
        """Compact plans: a smaller slot count once far more slots are reserved than used
        (else None); the layers keep their first ``used`` slots."""
        if not self.compact or self.pending_len or self.capacity - self.used <= self.SHRINK_SLACK:
            return None
        capacity = self.used + self.SHRINK_SLACK // 8
        self.positions = self.positions[:capacity].copy()
        self._changed()
        return capacity

    def select(self, indices: Sequence[int]) -> Moves | None:
        """Keep provisional entries ``indices`` (a draft tree's root-to-node path: they must
        hold consecutive positions from ``history_len``) as the provisional entries, dropping
        the others; ValueError, nothing changed, else. A compact plan returns the moves into
        the prefix slots (None when already there); otherwise only labels change."""
        idx = np.asarray(list(indices), dtype=np.int64)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.pending_len):
            raise ValueError(
                f"provisional entries {list(indices)} outside 0..{self.pending_len - 1}"
            )
        want = np.arange(self.history_len, self.history_len + idx.size, dtype=np.int64)
        sources = self.pending_slots[idx]
        if not np.array_equal(self.positions[sources], want):
            raise ValueError(
                f"provisional entries {list(indices)} are not a path of consecutive positions "
                f"from {self.history_len}"
            )
        self._changed()
        self.positions[self.pending_slots] = -1
        if not self.compact:
            self.positions[sources] = want
            self.pending_slots = sources
            return None
        destinations = self.used + np.arange(idx.size, dtype=np.int64)
        self.positions[destinations] = want
        self.pending_slots = destinations
        if np.array_equal(sources, destinations):
            return None
        return Moves(sources, destinations)

    def drop_provisional(self, keep: int = 0) -> None:
        """Keep the first ``keep`` provisional entries, forget the others."""
        self.positions[self.pending_slots[keep:]] = -1
        self.pending_slots = self.pending_slots[:keep]
        self._changed()

    def cached_positions(self) -> list[int]:
        """Absolute positions of the committed entries held, ascending."""
        committed = self.positions >= 0
        committed[self.pending_slots] = False
        return sorted(self.positions[committed].tolist())
