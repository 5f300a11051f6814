"""Plain and speculative decoding over the sink-window verifier (docs/design.md, "Proposers and speculative decoding").

A :class:`Decoder` runs one verifier forward per step. The block ``[x, d1..dk]`` holds
``x``, the last delivered token (not yet in the cache), and the proposer's draft ``d``;
row ``i`` of the block's logits predicts the token after ``block[:i+1]``, so it checks
``d[i]``. Plain decoding is the same loop with empty drafts (one token per forward).

* Greedy: accept drafts while they equal the verifier's argmax, then emit the verifier's
  own token. The verifier gives each block position the oracle's context, so the stream is
  identical to plain greedy decoding with the same cache, eviction included.
* Sampling: accept ``d`` with probability ``min(1, p(d)/q(d))``; on rejection draw from
  the normalised ``max(0, p - q)`` and stop; if every draft is accepted draw a bonus token
  from ``p``. This preserves the verifier's distribution (Leviathan et al. 2023).
  Deterministic drafts (``q`` one-hot) are the special case ``q(d) = 1``.

Draft trees (docs/design.md, "Draft trees"): a tree proposer's :class:`~kakeya_lab.tree.DraftTree`
is verified rooted at ``x`` in one forward; greedy acceptance follows the argmax child
from the root, sampling eliminates rejected siblings from ``p`` one by one; the accepted
root-to-node path is committed even when it is not a prefix of the block.

Delivery: a step's tokens stay *provisional* until handed out one by one with
:meth:`Decoder.deliver`. :meth:`Decoder.settle` commits exactly the delivered tokens,
rolls the rest of the step back (verifier block and proposer state) and leaves
``next_logits`` as the logits after the last delivered token, however the stream ended.

Interrupts (docs/design.md, "Interrupts"): the forwards and the proposer's drafting run
interruptibly and only ever produce *provisional* state (an open verifier block, a draft);
every change of the decoder's own state, each together with the verifier commit it
belongs to, runs as a short critical section with SIGINT deferred
(:func:`~kakeya_lab.backends.seam.interrupts_deferred`). A ``KeyboardInterrupt`` (or any
error) therefore leaves the decoder either before or after a step's bookkeeping, never in
between, and :meth:`Decoder.settle` (idempotent) can always finish from there. The proposer
is told what was accepted (``accept``) only after the commit, so a proposer that raises
cannot leave the history and the decoder out of step.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from typing import cast

import torch

from kakeya_lab import inputs
from kakeya_lab.backends.seam import interrupts_deferred
from kakeya_lab.cost_model import CostAwareDraftLength, CostAwareTreeSize, CostModel
from kakeya_lab.inputs import InputTypeError
from kakeya_lab.proposers import Draft, Proposer, TreeProposer, check_proposer, is_tree_proposer
from kakeya_lab.sampling import GREEDY, SamplingConfig
from kakeya_lab.session.events import SpeculativeStep
from kakeya_lab.tree import DraftTree
from kakeya_lab.verifier import Verifier


def accept_greedy(rows: torch.Tensor, draft: Sequence[int]) -> tuple[int, int]:
    """Accepted prefix length and the verifier's next token (greedy)."""
    targets = torch.argmax(rows, dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n, int(targets[n])


def accept_sampled(
    rows: torch.Tensor, draft: Draft, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[int, int]:
    """Rejection sampling: accepted prefix length and the next token (residual or bonus)."""
    tokens = draft.tokens
    for i, d in enumerate(tokens):
        p = sampling.probs(rows[i])
        if draft.probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft.probs[i].to(p)
        u = float(torch.rand((), generator=generator))
        if q[d] > 0 and u < min(1.0, float(p[d] / q[d])):
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        if total <= 0:  # p == q: the rejection had probability 0; sample p
            residual, total = p, p.sum()
        return i, int(torch.multinomial(residual / total, 1, generator=generator))
    p = sampling.probs(rows[len(tokens)])
    return len(tokens), int(torch.multinomial(p, 1, generator=generator))


def accept_greedy_tree(rows: torch.Tensor, block: DraftTree) -> tuple[list[int], int]:
    """Greedy acceptance over a verified tree block (node 0 the last emitted token): from
    the root, follow the child equal to the verifier's argmax while there is one. Returns
    the accepted nodes (block indices, root excluded) and the verifier's next token."""
    targets = torch.argmax(rows, dim=-1).tolist()
    path: list[int] = []
    node = 0
    while True:
        child = next((c for c in block.children(node) if block.tokens[c] == targets[node]), None)
        if child is None:
            return path, int(targets[node])
        path.append(child)
        node = child


def accept_sampled_tree(
    rows: torch.Tensor,
    block: DraftTree,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Rejection sampling over a verified tree block, preserving the verifier's distribution.

    At each node with deterministic children (distinct tokens ``d1, d2, ...``): accept
    ``d1`` with probability ``p(d1)``; on rejection set ``p(d1) = 0``, renormalise and try
    ``d2``, and so on; if every child is rejected draw from what is left of ``p``. Each
    token is thus emitted with exactly its probability under ``p``. A 1-wide tree with
    proposal distributions follows the chain rule (:func:`accept_sampled`). Returns the
    accepted nodes (root excluded) and the next token."""
    path: list[int] = []
    node = 0
    while True:
        p = sampling.probs(rows[node])
        children = block.children(node)
        if block.probs is not None and children:  # a chain with q: the chain rule
            (child,) = children
            d, q = block.tokens[child], block.probs[child].to(p)
            u = float(torch.rand((), generator=generator))
            if q[d] > 0 and u < min(1.0, float(p[d] / q[d])):
                path.append(child)
                node = child
                continue
            residual = torch.clamp(p - q, min=0.0)
            total = residual.sum()
            if total <= 0:
                residual, total = p, p.sum()
            return path, int(torch.multinomial(residual / total, 1, generator=generator))
        for child in children:
            d = block.tokens[child]
            u = float(torch.rand((), generator=generator))
            if u < float(p[d]):
                path.append(child)
                node = child
                break
            p = p.clone()
            p[d] = 0.0
            p = p / p.sum()
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


class AdaptiveDraftLength:
    """Grow the draft length by one after a fully accepted draft, shrink it after a draft
    that lost more than half; bounded to ``[1, max_draft_length]``."""

    def __init__(self, draft_length: int, max_draft_length: int | None = None):
        self.draft_length = draft_length
        self.max_draft_length = max_draft_length or 2 * draft_length

    def update(self, proposed: int, accepted: int) -> int:
        if proposed and accepted == proposed:
            self.draft_length = min(self.draft_length + 1, self.max_draft_length)
        elif proposed and accepted < proposed / 2:
            self.draft_length = max(1, self.draft_length - 1)
        return self.draft_length


class Decoder:
    """Decodes after ``verifier``'s committed history, whose next-token logits are ``next_logits``.

    ``proposer=None`` is plain decoding. A tree proposer (one with ``propose_tree``) gets
    the draft length as its node budget; the adaptive schedule then treats the tree's
    longest path as the drafted chain, and a ``cost_model`` chooses the node budget per step
    (:class:`~kakeya_lab.cost_model.CostAwareTreeSize`, at most ``draft_length``). Drive it with :meth:`advance` (one step; returns
    the :class:`SpeculativeStep` in speculative mode), then :meth:`deliver` each token of
    :attr:`batch`, until :attr:`finished`; always end with :meth:`settle`. Or iterate it
    (``for item in decoder``): token ids (and steps), each delivered as it is yielded,
    settled when the iteration ends or is abandoned.
    """

    def __init__(
        self,
        verifier: Verifier,
        next_logits: torch.Tensor,
        *,
        max_new_tokens: int,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
        stop_token_ids: Collection[int] = (),
        proposer: Proposer | None = None,
        draft_length: int = 4,
        adaptive_draft_length: bool = False,
        cost_model: CostModel | None = None,
    ):
        self.max_new_tokens = inputs.count(max_new_tokens, "max_new_tokens", minimum=1)
        self.sampling = sampling if sampling is not None else GREEDY
        if not isinstance(self.sampling, SamplingConfig):
            raise TypeError(
                f"sampling must be a SamplingConfig or None, got {type(sampling).__name__}"
            )
        if proposer is not None:
            check_proposer(proposer)
        draft_length = inputs.count(
            draft_length, "draft_length", minimum=1, maximum=inputs.MAX_SIZE
        )
        self.generator = generator if generator is not None else self.sampling.make_generator()
        self.stop_token_ids = inputs.stop_token_ids(stop_token_ids, verifier.vocab_size)
        self.verifier = verifier
        self.proposer = proposer
        self.draft_length = draft_length
        if adaptive_draft_length and cost_model is not None:
            raise ValueError(
                "adaptive_draft_length and cost_model are two draft-length schedules: give one"
            )
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise InputTypeError(
                f"cost_model must be a CostModel or None, got {type(cost_model).__name__}"
            )
        self.tree = proposer is not None and is_tree_proposer(proposer)
        self.schedule: AdaptiveDraftLength | CostAwareDraftLength | CostAwareTreeSize | None = None
        if proposer is not None and adaptive_draft_length:
            self.schedule = AdaptiveDraftLength(draft_length)
        elif proposer is not None and cost_model is not None and self.tree:
            self.schedule = CostAwareTreeSize(cost_model, max_nodes=draft_length)
        elif proposer is not None and cost_model is not None:
            self.schedule = CostAwareDraftLength(cost_model, max_draft_length=draft_length)
        self.next_logits = next_logits  # after the committed history (valid when pending is None)
        self.pending: int | None = None  # delivered, not yet in the cache
        self.delivered = 0
        self.delivered_ids: list[int] = []
        self._reply_reported = False
        self.stop_reason = "max_tokens"
        self.verifier_forwards = 0
        self.verifier_s = 0.0
        self.steps: list[SpeculativeStep] = []
        # the open step: its rows (None: the first token, sampled without a forward),
        # the tokens it offers, how many are in the verifier's block, how many delivered
        self._rows: torch.Tensor | None = None
        self._offered: list[int] = []
        self._in_block = 0
        self._taken = 0
        self._drafted = False  # the proposer may hold a draft not yet answered with accept()
        self._to_accept: int | None = None  # the answer owed to it (sent after the commit)
        self._path: list[int] | None = None  # a tree step: the accepted block nodes, root first
        self._last: int | None = None
        if proposer is not None:
            verifier.check_proposer(proposer)  # same backend (torch / mlx) or a clear error
            bind = getattr(proposer, "bind", None)
            if callable(bind):  # proposers that read the verifier's hidden states
                bind(verifier)

    # ----------------------------------------------------------------- driving
    @property
    def batch(self) -> list[int]:
        """Tokens of the current step not yet delivered, in order."""
        return self._offered[self._taken :]

    @property
    def finished(self) -> bool:
        if self.batch:
            return False
        if self._last is not None and self._last in self.stop_token_ids:
            return True
        return self.delivered >= self.max_new_tokens

    def advance(self) -> SpeculativeStep | None:
        """Run the next step (after the previous step's tokens were all delivered)."""
        if self.batch or self.finished:
            raise RuntimeError(
                "advance() needs every offered token delivered and the stream unfinished"
            )
        self._close_step()
        self._report_accept()
        if self.pending is None:  # the first token comes from the logits we already have
            self._offered = [self.sampling.choose(self.next_logits, self.generator)]
            return None
        x = self.pending
        room = self.max_new_tokens - self.delivered  # tokens this step may still emit (>= 1)
        length = self.schedule.draft_length if self.schedule else self.draft_length
        proposer = self.proposer
        length = min(length, room - 1) if proposer is not None else 0
        if proposer is not None and length > 0 and self.tree:
            return self._advance_tree(x, length, room)
        if proposer is not None and length > 0:
            self._drafted = True  # before propose: however it ends, accept() follows
            draft = proposer.propose(
                self.verifier.history_view([x]), length, self.sampling, self.generator
            )
            draft.tokens = list(draft.tokens)[:length]
        else:
            draft = Draft([], None, 0.0)
        t0 = time.perf_counter()
        rows = self.verifier.forward_block([x] + draft.tokens)
        verifier_s = time.perf_counter() - t0
        self.verifier_s += verifier_s
        self.verifier_forwards += 1
        try:
            if self.sampling.greedy:
                n, nxt = accept_greedy(rows, draft.tokens)
            else:
                n, nxt = accept_sampled(rows, draft, self.sampling, self.generator)
        except BaseException:
            self._roll_back_block()
            raise
        return self._offer(
            rows, draft.tokens[:n], nxt, length, len(draft.tokens), draft.seconds, verifier_s
        )

    def _advance_tree(self, x: int, length: int, room: int) -> SpeculativeStep | None:
        """A step verifying a draft tree of at most ``length`` nodes (docs/design.md,
        "Draft trees"); the accepted root-to-node path is committed by :meth:`_close_step`."""
        proposer = cast(TreeProposer, self.proposer)
        t_draft = time.perf_counter()
        self._drafted = True  # before propose_tree: however it ends, accept() follows
        tree = proposer.propose_tree(
            self.verifier.history_view([x]), length, self.sampling, self.generator
        )
        seconds = time.perf_counter() - t_draft
        if not isinstance(tree, DraftTree):
            raise TypeError(
                f"{type(proposer).__name__}.propose_tree must return a DraftTree, "
                f"got {type(tree).__name__}"
            )
        tree = tree.pruned(max_nodes=length, max_depth=room - 1)
        block = tree.rooted(x)
        t0 = time.perf_counter()
        try:
            rows = self.verifier.forward_tree(block)
        except BaseException:  # e.g. ids outside the vocabulary: nothing was written
            self._roll_back_block()
            raise
        verifier_s = time.perf_counter() - t0
        self.verifier_s += verifier_s
        self.verifier_forwards += 1
        try:
            if self.sampling.greedy:
                path, nxt = accept_greedy_tree(rows, block)
            else:
                path, nxt = accept_sampled_tree(rows, block, self.sampling, self.generator)
        except BaseException:
            self._roll_back_block()
            raise
        tokens = [block.tokens[i] for i in path]
        return self._offer(
            rows, tokens, nxt, length, len(tree), seconds, verifier_s, tree.depth, [0, *path]
        )

    def _offer(
        self,
        rows: torch.Tensor,
        accepted: list[int],
        nxt: int,
        length: int,
        proposed: int,
        proposer_s: float,
        verifier_s: float,
        depth: int | None = None,
        path: list[int] | None = None,
    ) -> SpeculativeStep | None:
        """Open the step: the verified block's ``rows`` and the tokens it offers (a tree
        step: ``path``, the accepted block nodes, root first)."""
        n = len(accepted)
        offered = accepted + [nxt]  # never more than `room` tokens
        first_stop = next((j for j, t in enumerate(offered) if t in self.stop_token_ids), None)
        if first_stop is not None:
            offered = offered[: first_stop + 1]
        with interrupts_deferred():  # the step's state is set as a whole
            self._rows, self._offered, self._taken, self._path = rows, offered, 0, path
            self._in_block = min(len(offered), n)  # offered drafts are block positions 1..n
        if self.proposer is None:
            return None
        step = SpeculativeStep(
            draft_length=length,
            proposed=proposed,
            accepted=n,
            emitted=len(offered),
            proposer_s=proposer_s,
            verifier_s=verifier_s,
            tree=self._path is not None,
        )
        self.steps.append(step)
        if isinstance(self.schedule, (CostAwareDraftLength, CostAwareTreeSize)):
            self.schedule.observe_draft(proposer_s, proposed)
        if isinstance(self.schedule, CostAwareTreeSize):
            if self._path is not None:  # tree nodes are block positions 1.. (0: the root)
                self.schedule.update_tree(proposed, [i - 1 for i in self._path[1:]])
        elif self.schedule:  # a tree's chain-like trial is its longest path
            self.schedule.update(step.proposed if depth is None else depth, n)
        return step

    def deliver(self) -> int:
        """Hand out the next token of :attr:`batch`; it will be committed. Atomic under
        SIGINT; a caller handing the token on must make that hand-off atomic with this call
        (:class:`~kakeya_lab.session.stream.GenerationStream` does)."""
        if not self.batch:
            raise RuntimeError("no offered token left to deliver: call advance()")
        with interrupts_deferred():
            token = self._offered[self._taken]
            self._taken += 1
            self.delivered += 1
            self.delivered_ids.append(token)
            self._last = token
            if token in self.stop_token_ids:
                self.stop_reason = "stop"
        return token

    def settle(self) -> None:
        """Commit exactly the delivered tokens and drop the rest of the open step; then
        ``next_logits`` follows the last delivered token. Idempotent. A proposer with an
        ``observe_reply(token_ids)`` method is then given the delivered tokens, once.

        Safe to call again after it was interrupted or after the proposer raised: each part
        is done at most once (the last delivered token's forward is the only interruptible
        part, and its commit and ``pending = None`` happen together)."""
        self._close_step()
        self.verifier.rollback()  # the rest of the step (or a forward left open by an interrupt)
        if self.pending is not None:
            t0 = time.perf_counter()
            self.verifier.append([self.pending], on_commit=self._pending_committed)
            self.verifier_s += time.perf_counter() - t0
        self._report_accept()
        observe = getattr(self.proposer, "observe_reply", None)
        if callable(observe) and not self._reply_reported:  # proposers that learn from replies
            self._reply_reported = True
            observe(list(self.delivered_ids))

    def __iter__(self) -> Iterator[int | SpeculativeStep]:
        try:
            while not self.finished:
                step = self.advance()
                if step is not None:
                    yield step
                while self.batch:
                    yield self.deliver()
        finally:
            self.settle()

    # ---------------------------------------------------------------- internals
    def _pending_committed(self, logits: torch.Tensor) -> None:
        """The last delivered token is in the cache (inside the verifier's commit section)."""
        self.next_logits, self.pending = logits, None
        self.verifier_forwards += 1

    def _roll_back_block(self) -> None:
        """Drop the verified block of a step that fails before it opens; the proposer is
        told nothing was accepted."""
        with interrupts_deferred():
            self.verifier.rollback()
            self._path = None
            if self._drafted:
                self._to_accept, self._drafted = 0, False
        self._report_accept()

    def _report_accept(self) -> None:
        """Tell the proposer how much of its draft was kept (after the commit, once)."""
        n, self._to_accept = self._to_accept, None
        if n is not None and self.proposer is not None:
            self.proposer.accept(n)

    def _close_step(self) -> None:
        """Commit the delivered part of the open step (block position 0 is the pending token).

        One critical section: the verifier commit, the decoder's state after it and the
        reset of the step happen together (SIGINT deferred) or not at all."""
        with interrupts_deferred():
            taken, offered, rows, path = self._taken, self._offered, self._rows, self._path
            keep = 0
            if rows is None:  # first-token step: no block
                if taken:
                    self.pending = offered[0]
            else:
                keep = min(taken, self._in_block)  # delivered tokens that are accepted drafts
                if path is None:
                    self.verifier.commit(1 + keep)
                else:  # a tree: the accepted nodes need not be a prefix of the block
                    self.verifier.commit_path(path[: 1 + keep])
                if taken > keep:  # the verifier's own token was delivered: next step's x
                    self.pending = offered[taken - 1]
                else:
                    self.pending = None
                    self.next_logits = rows[keep if path is None else path[keep]]
            if self._drafted:  # only a proposer drafts
                self._to_accept, self._drafted = keep, False
            self._rows, self._offered, self._taken, self._path = None, [], 0, None


def plain_decode(verifier: Verifier, next_logits: torch.Tensor, **options) -> Decoder:
    """A plain :class:`Decoder` (one verifier forward per token, tau = 1)."""
    return Decoder(verifier, next_logits, **options)


def speculative_decode(
    verifier: Verifier, next_logits: torch.Tensor, proposer: Proposer, **options
) -> Decoder:
    """A speculative :class:`Decoder` drafting with ``proposer``."""
    if proposer is None:
        raise ValueError("speculative_decode needs a proposer (use plain_decode without one)")
    return Decoder(verifier, next_logits, proposer=proposer, **options)
