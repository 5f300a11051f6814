"""Several sessions' steps in one forward: :class:`BatchForward` and :class:`StepBatcher`.

Every session has its own :class:`~kakeya_lab.backends.torch_cache.SinkWindowCache`; a
one-token step reads all of the model's weights for one row. :class:`BatchForward` runs
the pending blocks of several caches (a token each in plain decoding, a speculative block
each) as one forward: the embedding, the projections, the MLP and the lm_head run over
the rows of every block concatenated, so the weights are read once for all of them; the
rotary angles come from each row's own position; attention runs per cache, over that
cache's own key layout and mask. It is :class:`~kakeya_lab.backends.torch_lean.LeanForward`
itself, piece by piece (``embed``, ``rope``, ``layer``: one compiled call where it applies,
else ``qkv``, ``attend`` per cache and ``finish_layer``; ``logits``), so eviction, rolling positions and open blocks mean what
they mean for a solo forward, and a row computes what a solo lean step computes. Each block is left
provisional in its cache, as a solo forward leaves it: committing or rolling it back
stays its verifier's business.

:class:`StepBatcher` gathers the steps of concurrent threads (one per generating session,
as the session store and the server run them): a thread submits its step and waits; one
worker thread runs every step already waiting as one batch (after waiting for the
members of the previous batch that are about to come back, for at most a fraction of a
forward, see :class:`StepBatcher`), then hands every row its logits.
:class:`BatchedBackend` puts a verifier's short chain blocks through a batcher and
everything else (trees, hidden states, prefills) through its own backend, so a
:class:`~kakeya_lab.verifier.Verifier`'s semantics (all-or-nothing appends, commits and
rollbacks, interrupts) are unchanged: :func:`batch_verifier` installs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from kakeya_lab.backends.seam import CacheBackend, Forward, interrupts_deferred
from kakeya_lab.backends.thread_pool import release_thread_pool
from kakeya_lab.backends.torch_cache import SinkWindowCache
from kakeya_lab.backends.torch_lean import LeanForward, step_mask
from kakeya_lab.tree import DraftTree

MAX_BLOCK = 64  # a session's block in a batch (a token, a speculative block, a chat turn's
# append); longer ones (long prompts) run alone, so one cannot hold up every session's step
BATCH_ROWS = 512  # a batch's rows (StepBatcher's default): prompts that arrive together prefill
# in one forward. A product's rate grows with its rows (on 2 Zen 4 cores a 576 x 1536 product
# runs at 77 GFLOP/s for 35 rows, 162 for 280), so eight 39-token prompts cost 0.43 s in one
# forward against 0.74 s one by one (oneDNN), and the sessions waiting behind them wait less
# in all


@dataclass
class BatchStep:
    """One cache's part of a batched forward: append ``token_ids`` to ``cache`` as a
    provisional block; ``all_rows``: logits of every row, else of the last."""

    cache: SinkWindowCache
    token_ids: list[int]
    all_rows: bool
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class BatchForward:
    """``model``'s forward of several caches' blocks at once (module docstring). It holds
    no state between calls; build it with :meth:`of` (one per model). The model must be
    one :class:`LeanForward` supports (Llama, Qwen2, Qwen3 stacks of linear layers)."""

    def __init__(self, model: PreTrainedModel):
        problem = LeanForward.unsupported(model)
        if problem:
            raise ValueError(f"BatchForward does not support this model: {problem}")
        self.model = model
        self.forwards = 0  # batched forwards so far
        self.rows = 0  # rows they carried (rows / forwards: the mean batch)

    @classmethod
    def of(cls, model: PreTrainedModel) -> BatchForward:
        """The batched forward of ``model``, built once and kept with the model."""
        batch = model.__dict__.get("_batch_forward")
        if batch is None:
            batch = model.__dict__["_batch_forward"] = cls(model)
        return batch

    @classmethod
    def supports(cls, model: Any) -> bool:
        """Whether :class:`BatchForward` can run ``model`` (a torch model LeanForward runs)."""
        return isinstance(model, PreTrainedModel) and LeanForward.supports(model)

    @torch.inference_mode()
    def __call__(self, steps: Sequence[BatchStep]) -> list[torch.Tensor]:
        """Append each step's tokens to its cache as a provisional block; per step, float32
        logits ``[rows, vocab]`` (every row, or the last). All or nothing: on any exception
        every cache is cut back to where it was (its partial block dropped) and the
        exception is raised."""
        if not steps:
            return []
        caches = [s.cache for s in steps]
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a batched forward takes each cache at most once")
        for s in steps:
            if not 1 <= len(s.token_ids) <= MAX_BLOCK:
                raise ValueError(
                    f"a batched block has 1 to {MAX_BLOCK} tokens, got {len(s.token_ids)}"
                )
        starts = [c.next_position for c in caches]
        try:
            return self._forward(steps, starts)
        except BaseException:
            for cache, start in zip(caches, starts):
                cache.crop(start)  # this forward's partial block only
            raise

    def _forward(self, steps: Sequence[BatchStep], starts: list[int]) -> list[torch.Tensor]:
        # LeanForward's own pieces (for the model's current kernel), over every row at once
        # but attention, which runs per cache (LeanForward.attend_all)
        lean = LeanForward.of(self.model)
        self.forwards += 1
        sizes = [len(s.token_ids) for s in steps]
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        self.rows += bounds[-1]
        caches = [s.cache for s in steps]
        x = lean.embed([t for s in steps for t in s.token_ids])  # [rows, hidden]
        cos, sin = lean.rope(x, [p for p0, n in zip(starts, sizes) for p in range(p0, p0 + n)])
        # as a solo step: one token that sees every column needs no mask
        masks, seen = [], []
        for s, n in zip(steps, sizes):
            mask, rows_seen = step_mask(s.cache.get_mask_sizes(n, 0)[1], n)
            masks.append(mask)
            seen.append(rows_seen)
        for i in range(len(lean.layers)):
            x = lean.layer(i, x, cos, sin, caches, bounds, masks, seen)
        keep = [
            torch.arange(bounds[j] if s.all_rows else bounds[j + 1] - 1, bounds[j + 1])
            for j, s in enumerate(steps)
        ]
        logits = lean.logits(x[torch.cat(keep).to(x.device)])
        # copies: a view would keep the whole batch's logits alive as long as any one
        # session holds its row (its next-token logits)
        return [part.clone() for part in logits.split([len(r) for r in keep])]


def take_batch(waiting: Sequence[BatchStep], max_rows: int) -> list[BatchStep]:
    """The steps the next batch runs: the waiting ones in order (first come, first served)
    while their rows fit in ``max_rows``; the first always, whatever its rows."""
    batch: list[BatchStep] = []
    rows = 0
    for s in waiting:
        if batch and rows + len(s.token_ids) > max_rows:
            break
        batch.append(s)
        rows += len(s.token_ids)
    return batch


class StepBatcher:
    """Gathers concurrent threads' steps into :class:`BatchForward` calls (continuous
    batching): :meth:`run` submits one step and waits for its logits.

    One worker thread (started on demand, ended after ``idle_s`` without work) runs every
    batch, a lone session's step too: it takes every step waiting, runs them as one forward
    and hands each its logits (or the error); steps submitted meanwhile go into the next
    batch. One thread computes every forward, so the forwards' temporaries come from one
    allocator arena, not one per generating thread, and one OpenMP pool runs their parallel
    parts: a submitting thread lets its own pool go before it waits
    (:func:`~kakeya_lab.backends.thread_pool.release_thread_pool`; with more OpenMP threads
    alive than CPUs every parallel region pays a wake-up, 1.6x slower steps on 2 cores).
    The hand-off costs a lone session a thread switch a step. Before a batch the worker
    waits for the members of the previous batch that have not come back yet (each session
    commits and samples its row between two steps; without this wait the first one back
    would run alone while the others queue behind it), for at most ``gather`` times the
    last forward's duration (0: never wait); a member whose generation ended says so with
    :meth:`leave` and is not waited for. A batch takes the waiting steps in order up to
    ``max_rows`` rows (one step always), so short prompts that arrive together prefill in
    one forward (:data:`BATCH_ROWS`).

    If a forward fails, every cache in it is cut back to where it was and every member gets
    the error. An interrupt of a submitting thread withdraws its step if it is still
    waiting; if its forward is running, the thread waits for it (SIGINT deferred: another
    thread is writing its cache), then raises; its verifier drops the block it never
    recorded, as after any interrupted forward.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        gather: float = 0.25,
        max_rows: int = BATCH_ROWS,
        idle_s: float = 1.0,
    ):
        if not 0 <= gather <= 1:
            raise ValueError(f"gather is a fraction of a forward in [0, 1], got {gather}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.forward = BatchForward.of(model)
        self.gather = gather
        self.max_rows = max_rows
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._waiting: list[BatchStep] = []
        self._worker: threading.Thread | None = None
        self._expected: set[int] = set()  # ids of caches in the last batch, not yet back
        self._computing = False  # the worker is running a batch
        self._last_forward_s = 0.0
        self.batches: list[int] = []  # rows of each batch run so far (most recent last)

    def leave(self, cache: SinkWindowCache) -> None:
        """``cache``'s generation ended: the next batch does not wait for it."""
        with self._cond:
            self._expected.discard(id(cache))
            self._cond.notify_all()

    def run(
        self, cache: SinkWindowCache, token_ids: Sequence[int], *, all_rows: bool
    ) -> torch.Tensor:
        """Append ``token_ids`` to ``cache`` as a provisional block in the next batched
        forward; its float32 logits ``[rows, vocab]`` (every row, or the last)."""
        step = BatchStep(cache, list(token_ids), all_rows)
        release_thread_pool()  # the worker computes: this thread's OpenMP pool would slow it
        with self._cond:
            self._expected.discard(id(cache))
            self._waiting.append(step)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="kakeya-batch", daemon=True)
                self._worker.start()
            self._cond.notify_all()
            try:
                while not step.done:
                    self._cond.wait()
            except BaseException:
                if step in self._waiting:  # not taken yet: withdrawn
                    self._waiting.remove(step)
                else:  # being computed: the worker is writing this cache
                    with interrupts_deferred():
                        while not step.done:
                            self._cond.wait()
                raise
        if step.error is not None:
            raise step.error
        assert step.logits is not None
        return step.logits

    def _work(self) -> None:
        """The worker: batches until ``idle_s`` pass with nothing waiting. With nothing to
        do for a forward's time (a generating session's next step comes sooner), it lets
        its OpenMP pool go: another thread may compute meanwhile (a long prompt's prefill)."""
        with self._cond:
            try:
                while True:
                    if not self._waiting:
                        self._cond.wait(self._last_forward_s)
                    if not self._waiting:
                        release_thread_pool()
                        self._cond.wait(self.idle_s)
                        if not self._waiting:
                            return
                    self._batch()
            finally:
                self._worker = None
                if self._waiting:  # a submission raced the exit: serve it
                    self._worker = threading.Thread(
                        target=self._work, name="kakeya-batch", daemon=True
                    )
                    self._worker.start()

    def _batch(self) -> None:
        """Under the condition's lock: gather, run one batch (lock released meanwhile),
        hand out its results."""
        deadline = time.monotonic() + self.gather * self._last_forward_s
        while self._expected and self._rows_waiting() < self.max_rows:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
        batch = take_batch(self._waiting, self.max_rows)
        rows = sum(len(s.token_ids) for s in batch)
        if not batch:  # every waiting step was withdrawn meanwhile
            return
        del self._waiting[: len(batch)]
        self._expected.clear()
        error: BaseException | None = None
        results: list[torch.Tensor] = []
        self._computing = True
        self._cond.release()
        t0 = time.perf_counter()
        try:
            results = self.forward(batch)
        except BaseException as e:  # every member's (a hook's KeyboardInterrupt too)
            error = e
        finally:
            self._cond.acquire()
            self._computing = False
        self._last_forward_s = time.perf_counter() - t0
        self.batches.append(rows)
        del self.batches[:-1000]
        if error is None:
            for s, logits in zip(batch, results):
                s.logits = logits
                self._expected.add(id(s.cache))
        for s in batch:
            s.error, s.done = error, True
        self._cond.notify_all()

    def _rows_waiting(self) -> int:
        return sum(len(s.token_ids) for s in self._waiting)


class BatchedBackend(CacheBackend):
    """A verifier's torch backend whose short chain blocks (at most :data:`MAX_BLOCK`
    tokens, no tree, no hidden states) run through a :class:`StepBatcher`; everything
    else goes to the wrapped backend. Commits, rollbacks and the cache are the wrapped
    backend's."""

    def __init__(self, inner: Any, batcher: StepBatcher):
        if getattr(inner, "name", None) != "torch":
            raise ValueError(f"batched steps need a torch verifier, got backend {inner.name!r}")
        self.inner = inner
        self.batcher = batcher
        self.name = inner.name
        self.config = inner.config
        self.vocab_size = inner.vocab_size
        self.hidden_states = inner.hidden_states
        self.cache = inner.cache
        self.batched = 0  # forwards that went through the batcher

    def forward(
        self,
        token_ids: Sequence[int],
        *,
        all_rows: bool,
        hidden: bool = False,
        tree: DraftTree | None = None,
    ) -> Forward:
        ids = list(token_ids)
        if tree is None and not hidden and 1 <= len(ids) <= MAX_BLOCK:
            self.batched += 1
            return Forward(self.batcher.run(self.cache, ids, all_rows=all_rows), None)
        return self.inner.forward(ids, all_rows=all_rows, hidden=hidden, tree=tree)

    def reset(self) -> None:
        self.inner.reset()


def batch_verifier(verifier: Any, batcher: StepBatcher) -> None:
    """Route ``verifier``'s short chain blocks through ``batcher`` (idempotent). Its
    results, commits and rollbacks stay the verifier's own."""
    if isinstance(verifier.backend, BatchedBackend):
        verifier.backend.batcher = batcher
        return
    verifier.backend = BatchedBackend(verifier.backend, batcher)
