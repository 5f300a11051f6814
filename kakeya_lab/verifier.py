"""The verifier: a causal LM over a sink-window cache, with provisional blocks.

``append`` commits tokens and returns the next-token logits; ``forward_block`` scores a
provisional block (logits for every position) that ``commit(n)`` keeps in part and
``rollback()`` drops; ``forward_tree`` scores a draft tree (positions by depth, each
node seeing its ancestors only) whose accepted root-to-node path ``commit_path`` keeps.
Every forward gives each position the oracle's context (the attention mask is built from
positions, see :mod:`kakeya_lab.backends.plan`), so a block, a chunked append, a tree and
token-by-token decoding agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kakeya_lab import inputs
from kakeya_lab.backends import registry
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.seam import check_same_backend, interrupts_deferred
from kakeya_lab.tree import DraftTree


def check_token_ids(token_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> list[int]:
    """Return ``token_ids`` as a list of ints, or raise ``TypeError``/``ValueError`` saying
    what is wrong (the policy of :func:`kakeya_lab.inputs.token_ids`)."""
    from kakeya_lab import inputs

    return inputs.token_ids(token_ids, vocab_size)


class HiddenTrace:
    """The verifier's final hidden states (the lm_head's input, ``[hidden]`` per token) for
    the positions it scored most recently, keyed by global position.

    A forward starting at position ``s`` invalidates every stored position ``>= s`` (they
    belonged to a dropped provisional block) before storing its own rows, so a stored row
    is always the one for the token now at that position. ``capacity`` bounds how many of
    the latest positions are kept (``None``: all, for rollout capture).
    """

    def __init__(self, capacity: int | None = 64):
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity
        self._rows: dict[int, tuple[int, torch.Tensor]] = {}

    def record(self, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        for pos in [p for p in self._rows if p >= start]:
            del self._rows[pos]
        for i, (token, row) in enumerate(zip(token_ids, hidden)):
            self._rows[start + i] = (int(token), row)
        if self.capacity is not None:
            horizon = start + len(token_ids) - self.capacity
            for pos in [p for p in self._rows if p < horizon]:
                del self._rows[pos]

    def features(self, positions: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor | None:
        """Rows ``[len(positions), hidden]`` if every position is held with that token, else None."""
        rows = []
        for pos, token in zip(positions, token_ids):
            held = self._rows.get(pos)
            if held is None or held[0] != token:
                return None
            rows.append(held[1])
        return torch.stack(rows) if rows else None

    def held_suffix(self, context: Sequence[int], max_len: int) -> int:
        """How many of the last ``max_len`` positions of ``context`` are held, contiguously
        back from the end."""
        n = 0
        for pos in range(len(context) - 1, max(len(context) - 1 - max_len, -1), -1):
            held = self._rows.get(pos)
            if held is None or held[0] != context[pos]:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._rows)


class TokenHistory(Sequence[int]):
    """A read-only view of a committed token history followed by ``tail`` (e.g. the emitted
    token not yet in the cache), without copying the history: what a proposer reads every
    step, so its cost does not grow with the conversation. Valid until the history changes;
    a slice is materialised (only the slice)."""

    __slots__ = ("_ids", "_tail")

    def __init__(self, ids: list[int], tail: Sequence[int] = ()) -> None:
        self._ids = ids
        self._tail = list(tail)

    def __len__(self) -> int:
        return len(self._ids) + len(self._tail)

    def __getitem__(self, index):
        n, total = len(self._ids), len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(total)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return (
                self._ids[start : min(stop, n)] + self._tail[max(start - n, 0) : max(stop - n, 0)]
            )
        if index < 0:
            index += total
        if not 0 <= index < total:
            raise IndexError(f"token index {index} outside a history of {total}")
        return self._ids[index] if index < n else self._tail[index - n]


class Verifier:
    """Scores tokens for one sequence through a sink-window cache on a
    :mod:`backend <kakeya_lab.backends>`.

    ``model`` is a model of any registered backend (:mod:`kakeya_lab.backends.registry`):
    a transformers ``PreTrainedModel`` (torch) or an mlx-lm model (MLX,
    ``load_model(..., backend="mlx")``); everything here is the same on all. ``prefill_chunk`` bounds how many tokens go through one forward in
    :meth:`append` (chunking does not change the result). ``block_padding`` (PyTorch
    backend; see :func:`kakeya_lab.cost_model.block_padding`) maps a block size ``n`` to a
    larger size this machine scores faster: :meth:`forward_block` then runs ``n`` tokens
    plus copies of the last up to that size and drops the copies, so its logits, the cache
    and the hidden trace are those of the ``n`` tokens (up to float rounding of the other
    matrix shape). ``lean`` chooses the forward of one-token steps, short chain blocks
    and small draft trees on the torch backend:
    :class:`~kakeya_lab.backends.torch_lean.LeanForward`, the same layers as one straight
    sequence of tensor operations (the dense oracle's logits as tightly as transformers'
    forward), used when it supports the model; ``None`` (the default) uses it unless the
    model runs a quantised kernel, ``True`` also then (a draft model's cache), ``False``
    never (transformers' forward, the reference, which hidden-state traces and long
    chunks or trees always run). Other backends have one forward.
    """

    def __init__(
        self,
        model: Any,
        config: SinkWindowConfig,
        *,
        prefill_chunk: int = 512,
        block_padding: Mapping[int, int] | None = None,
        lean: bool | None = None,
    ):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        for n, m in (block_padding or {}).items():
            if not (isinstance(n, int) and isinstance(m, int) and 1 <= n <= m):
                raise ValueError(
                    f"block_padding maps a block size to a size at least as large, got {n} -> {m}"
                )
        self.backend = registry.make_backend(model, config, block_padding=block_padding, lean=lean)
        self.model = model
        self.config = config
        self.prefill_chunk = prefill_chunk
        self.vocab_size = self.backend.vocab_size
        self._history: list[int] = []
        self._pending: list[int] = []
        self._tree: DraftTree | None = None  # the open block when it is a draft tree
        self._tree_hidden: torch.Tensor | None = None
        self.trace: HiddenTrace | None = None  # set to record final hidden states

    @property
    def backend_name(self) -> str:
        """The registered backend's name (``"torch"``, ``"mlx"``)."""
        return self.backend.name

    @property
    def cache(self) -> Any:
        """The backend's cache object (read its state; mutate through the verifier)."""
        return self.backend.cache

    def check_proposer(self, proposer: Any) -> None:
        """Raise ValueError if ``proposer`` runs on another backend than this verifier."""
        check_same_backend(self.backend_name, proposer)

    def release(self) -> None:
        """Free the cache's storage and forget the history (a closed session)."""
        self.backend.reset()
        self._history, self._pending = [], []
        self._tree, self._tree_hidden = None, None

    def trace_hidden(self, capacity: int | None = 64) -> HiddenTrace:
        """Start recording final hidden states (kept if already on with enough capacity).

        Only on a backend with ``hidden_states`` (torch); others raise NotImplementedError
        (a hidden-state drafter cannot be bound to an MLX verifier)."""
        if not self.backend.hidden_states:
            raise NotImplementedError(
                f"hidden-state traces are only implemented on the torch backend (this verifier runs "
                f"on {self.backend_name}): use an n-gram or draft-model proposer, or a torch verifier"
            )
        t = self.trace
        if t is None or (t.capacity is not None and (capacity is None or t.capacity < capacity)):
            self.trace = t = HiddenTrace(capacity)
        return t

    # ---------------------------------------------------------------- forwards
    def _forward(self, ids: list[int], all_rows: bool) -> torch.Tensor:
        start = self.backend.next_position
        out = self.backend.forward(ids, all_rows=all_rows, hidden=self.trace is not None)
        if self.trace is not None and out.hidden is not None:
            self.trace.record(start, ids, out.hidden)
        return out.logits

    def append(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        *,
        on_commit: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Commit ``token_ids`` and return the next-token logits ``[vocab]`` after them.

        All or nothing: the chunks of ``prefill_chunk`` tokens go through the cache as one
        growing provisional block that is committed (and evicted) once at the end, so any
        exception before that, ``KeyboardInterrupt`` included, rolls it back and leaves the
        verifier exactly as before the call. The commit runs with SIGINT deferred
        (:func:`~kakeya_lab.backends.seam.interrupts_deferred`); ``on_commit(logits)`` runs
        inside that same section, so a caller's bookkeeping is published together with the
        commit or not at all (a deferred interrupt is raised after both). The cost: the
        provisional K/V of the whole append is held until the commit (``len(token_ids) ×
        layers × kv_heads × head_dim × 2 × dtype_bytes`` on top of the budget), and a later
        chunk's attention spans every earlier chunk of the same append (masked to the
        window), so chunking bounds the activations of one forward but not the K/V of one
        append.
        """
        ids = check_token_ids(token_ids, self.vocab_size)
        if self._pending:
            raise RuntimeError("a provisional block is open: commit(n) or rollback() first")
        self._discard_dangling()
        logits = None
        committed = False
        try:
            for i in range(0, len(ids), self.prefill_chunk):
                logits = self._forward(ids[i : i + self.prefill_chunk], all_rows=False)[-1]
            assert logits is not None  # check_token_ids rejects an empty append
            with interrupts_deferred():
                self.backend.commit(len(ids))
                self._history.extend(ids)
                if on_commit is not None:
                    on_commit(logits)
                committed = True
        except BaseException:
            if not committed:
                self.backend.rollback()
            raise
        return logits

    def append_copied(self, source: Verifier, token_ids: Sequence[int]) -> bool:
        """Commit ``token_ids`` (the tokens right after this verifier's history) with the
        keys and values ``source``'s cache holds for them at the same positions, instead of
        a forward: how a draft model that is a copy of the verifier (its own weights,
        quantised) takes a prompt the verifier already read, its steps after it being its
        own. No logits (the next forward gives them). False, nothing changed, when it
        cannot: another backend, no such entries (``source``'s history differs there or
        before, or it evicted them), or layers of other shapes; then :meth:`append` them."""
        ids = check_token_ids(token_ids, self.vocab_size)
        start = len(self._history)
        if (
            self._pending
            or source.backend_name != "torch"
            or self.backend_name != "torch"
            or source.history_len < start + len(ids)
            or source._history[: start + len(ids)] != self._history + ids
        ):
            return False
        self._discard_dangling()
        dtype = getattr(self.model, "dtype", None) or torch.float32
        with interrupts_deferred():  # copied and committed as a whole, or not at all
            try:
                if not self.backend.cache.copy_entries(source.backend.cache, len(ids), dtype):
                    return False
                self.backend.commit(len(ids))
            except BaseException:
                self.backend.rollback()
                raise
            self._history.extend(ids)
        return True

    def _discard_dangling(self) -> None:
        """Drop provisional entries the verifier does not know about: a forward whose
        result never reached ``_pending`` because an interrupt struck in between."""
        if not self._pending and self.backend.pending_len:
            self.rollback()

    def forward_block(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Score a provisional block: logits ``[k, vocab]``, row ``i`` predicting after ``ids[:i+1]``.

        Nothing is committed or evicted; a second call extends the open block.
        """
        ids = check_token_ids(token_ids, self.vocab_size)
        if self._tree is not None:
            raise RuntimeError("a draft tree is open: commit_path(nodes) or rollback() first")
        self._discard_dangling()
        logits = self._forward(ids, all_rows=True)
        self._pending.extend(ids)
        return logits

    def forward_tree(self, tree: DraftTree) -> torch.Tensor:
        """Score a draft tree in one forward (docs/design.md, "Draft trees"): logits
        ``[len(tree), vocab]``, row ``i`` predicting after ``history + path(i)``.

        Node ``i`` sits at position ``next_position + depth(i)`` and attends to the cache
        under the visibility rule and, inside the block, to its ancestors only. Needs no
        open block; the tree stays provisional until :meth:`commit_path` (or
        :meth:`rollback`). A tree with an id outside the vocabulary, or an empty one, is a
        ValueError and changes nothing.
        """
        if not isinstance(tree, DraftTree):
            raise TypeError(
                f"forward_tree takes a kakeya_lab.tree.DraftTree, got {type(tree).__name__}"
            )
        if not len(tree):
            raise ValueError("an empty draft tree: nothing to verify")
        tree.check_vocab(self.vocab_size)
        if self._pending:
            raise RuntimeError("a provisional block is open: commit(n) or rollback() first")
        self._discard_dangling()
        out = self.backend.forward(
            list(tree.tokens), all_rows=True, hidden=self.trace is not None, tree=tree
        )
        self._pending = list(tree.tokens)
        self._tree, self._tree_hidden = tree, out.hidden
        return out.logits

    def commit_path(self, nodes: Sequence[int]) -> None:
        """Commit the open tree's root-to-node path ``nodes`` (node indices, a root first,
        each the parent of the next; empty: nothing), drop every other node, then evict.

        The path need not be a prefix of the tree's storage order: its K/V are moved into
        the slots a prefix would occupy first. ValueError, nothing changed, if ``nodes`` is
        not such a path.
        """
        tree = self._tree
        if tree is None:
            raise RuntimeError("no draft tree is open: forward_tree(tree) first")
        path = list(nodes)
        if not tree.is_path(path):
            raise ValueError(
                f"{path} is not a root-to-node path of the open draft tree (parents "
                f"{list(tree.parents)}): start at a root (parent -1), each node a child of the last"
            )
        with interrupts_deferred():
            start = self.backend.next_position - len(self._pending)
            self.backend.select(path)
            self.backend.commit(len(path))
            tokens = [tree.tokens[i] for i in path]
            self._history.extend(tokens)
            if self.trace is not None and self._tree_hidden is not None and path:
                self.trace.record(start, tokens, self._tree_hidden[path])
            self._pending, self._tree, self._tree_hidden = [], None, None

    def commit(self, n: int) -> None:
        """Keep the first ``n`` tokens of the open block, drop the rest (then evict).
        For an open draft tree: its first ``n`` nodes, which must form a path."""
        if self._tree is not None:
            self.commit_path(list(range(inputs.count(n, "commit n", minimum=0))))
            return
        n = inputs.count(
            n,
            "commit n",
            minimum=0,
            maximum=len(self._pending),
            hint="tokens of the open block to keep",
        )
        with interrupts_deferred():
            self.backend.commit(n)
            self._history.extend(self._pending[:n])
            self._pending = []

    def rollback(self) -> None:
        """Drop the open block (also one a forward left behind unrecorded); the committed
        history and cache are unchanged. Runs with SIGINT deferred, so it is never half done."""
        with interrupts_deferred():
            self.backend.rollback()
            self._pending = []
            self._tree, self._tree_hidden = None, None

    # ------------------------------------------------------------------- state
    @property
    def kv_live_bytes(self) -> int:
        return self.backend.kv_live_bytes()

    def kv_budget_bytes(self) -> int | None:
        """The analytic budget ``B × layers × kv_heads × head_dim × dtype_bytes × 2`` (None: full cache)."""
        return self.backend.kv_budget_bytes()

    @property
    def cache_len(self) -> int:
        """Committed entries held by the cache (``<= sink + window``)."""
        return self.backend.cache_len

    @property
    def history_len(self) -> int:
        """Committed tokens since the start."""
        return len(self._history)

    @property
    def pending_len(self) -> int:
        return len(self._pending)

    @property
    def history_token_ids(self) -> list[int]:
        """A copy of the committed history (see :meth:`history_view` for a cheap view)."""
        return list(self._history)

    def history_view(self, tail: Sequence[int] = ()) -> TokenHistory:
        """The committed history followed by ``tail``, as a view (no copy)."""
        return TokenHistory(self._history, tail)

    @property
    def cached_token_ids(self) -> list[int]:
        """Ids of the committed entries the cache holds, in position order."""
        return [self._history[p] for p in self.backend.cached_positions()]

    def cached_positions(self) -> list[int]:
        return self.backend.cached_positions()
