"""Cost-aware drafting: this machine's verifier block cost, a drafter's cost, and the draft
length that maximises expected tokens per second.

On a CPU a verifier block of ``n`` tokens is compute-bound, so it costs more than one
token's forward; Leviathan et al.'s speedup ``(1 - a^(k+1)) / ((1 - a)(k c + 1))``
assumes it does not. Here the block cost ``v(n)`` is measured per block size
(:func:`measure_block_cost`) and kept as the median of each size, with the least-squares
line ``fixed_s + per_token_s · n`` beyond the sizes measured (:func:`fit_block_cost`).
The medians matter because a kernel's cost is a staircase, not a line: where a product
shares each weight's unpacking between up to 8 rows, a block of 9 tokens costs a step
more than a block of 8. The drafter costs ``draft_token_s`` per drafted token, and a step
drafting ``k`` tokens with per-token acceptance probability ``a`` (drafts accepted
independently, as in the geometric model) yields ``E[tokens] = (1 - a^(k+1)) / (1 - a)``
in ``v(k + 1) + k · draft_token_s`` seconds. Plain decoding is ``k = 0``: one token per
``v(1)``.

The two schedules need no acceptance model. :class:`CostAwareTreeSize` sets a draft
tree's node budget. A tree proposer stores its nodes best first, so any prefix of ``N``
nodes is itself a tree, and a node is accepted exactly when its whole path is; the
expected number of accepted nodes of the ``N``-node prefix is therefore
``sum(p_i for i < N)``, ``p_i`` the probability that the node at rank ``i`` lies on the
accepted path. The schedule estimates each ``p_i`` from the steps so far and asks for the
``N`` with the most expected tokens, ``1 + sum(p_i)``, per second of
``v(N + 1) + N · draft_token_s``.

:class:`CostAwareDraftLength` is the same schedule for a chain of drafts (a tree with one
path: draft position ``i`` is accepted exactly when the ``i + 1`` first drafts are), for
:class:`~kakeya_lab.speculative.Decoder`'s draft length. Acceptance by position need not
be geometric: a suffix match's long drafts tend to land whole or fail at the first token,
and a flat ``p_i`` then pays for long drafts that a single per-token ``a`` would cut.

Both schedules take the drafter's cost from the decoding itself once it has drafted (the
seconds its steps spent drafting, per drafted token or node), so a model drafter's cost is
this machine's, whatever the :class:`CostModel` was given.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from kakeya_lab import inputs


@dataclass(frozen=True)
class BlockCost:
    """Seconds for one verifier forward over a block of ``n`` tokens.

    ``measured``: ``(size, seconds)`` pairs timed on this machine, sizes ascending. A
    measured size costs its time, a size between two measured ones the straight line
    between them; outside the measured range (or with nothing measured) a block costs the
    line ``fixed_s + per_token_s · n`` (:meth:`line`)."""

    fixed_s: float
    per_token_s: float
    measured: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        sizes = [n for n, _ in self.measured]
        if sizes != sorted(set(sizes)):
            raise ValueError(f"measured block sizes must be distinct and ascending, got {sizes}")

    def line(self, n: int) -> float:
        """The fitted line at ``n``."""
        return self.fixed_s + self.per_token_s * n

    def __call__(self, n: int) -> float:
        points = self.measured
        if not points or not points[0][0] <= n <= points[-1][0]:
            return self.line(n)
        i = bisect.bisect_left(points, n, key=lambda p: p[0])
        n1, t1 = points[i]
        if n1 == n:
            return t1
        n0, t0 = points[i - 1]
        return t0 + (t1 - t0) * (n - n0) / (n1 - n0)


def fit_block_cost(timings: Mapping[int, Sequence[float]]) -> BlockCost:
    """The median time of each block size (at least two sizes), and the least-squares line
    through those medians for the sizes not measured."""
    points = [(int(n), statistics.median(ts)) for n, ts in sorted(timings.items()) if ts]
    if len(points) < 2:
        raise ValueError("fitting a block cost needs timings for at least two block sizes")
    xs, ys = [float(n) for n, _ in points], [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return BlockCost(fixed_s=my - slope * mx, per_token_s=slope, measured=tuple(points))


def measure_block_cost(
    verifier, sizes: Iterable[int] = range(1, 10), repeats: int = 5, token_id: int = 0
) -> dict[int, list[float]]:
    """Time ``verifier.forward_block`` on blocks of each size after the verifier's current
    history (then rolled back: the verifier is unchanged). Sizes are interleaved across
    repeats so slow drifts of the machine affect every size alike."""
    repeats = inputs.count(repeats, "repeats", minimum=1)
    sizes = [inputs.count(n, "a block size", minimum=1) for n in sizes]
    if verifier.pending_len:
        raise ValueError("measure_block_cost needs a verifier with nothing provisional")
    out: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            t0 = time.perf_counter()
            verifier.forward_block([token_id] * n)
            out[n].append(time.perf_counter() - t0)
            verifier.rollback()
    return out


def block_padding(timings: Mapping[int, Sequence[float]], margin: float = 0.05) -> dict[int, int]:
    """Which measured block size to score a chain block of ``n`` tokens at: the cheapest
    size ``m >= n`` by median time, where it is at least ``margin`` cheaper than ``n``
    itself (else ``n``). Sizes without a cheaper larger one map to themselves, size 1
    always does (a plain decoding step). A BLAS can make a few rows dearer than more:
    MKL's single-precision product of 3 rows by SmolLM2's lm_head takes twice as long as
    of 4 (``benchmarks/verify_cost.py``)."""
    margin = inputs.number(margin, "margin", minimum=0.0)
    med = {int(n): statistics.median(ts) for n, ts in timings.items() if ts}
    plan = {}
    for n in sorted(med):
        best = min((m for m in med if m >= n), key=lambda m: (med[m], m))
        plan[n] = best if n > 1 and med[best] < (1.0 - margin) * med[n] else n
    return plan


def expected_tokens(acceptance: float, draft_length: int) -> float:
    """Expected tokens per step: accepted drafts plus the verifier's own token."""
    a, k = acceptance, draft_length
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class CostModel:
    """The verifier's :class:`BlockCost` and the drafter's seconds per drafted token."""

    block: BlockCost
    draft_token_s: float

    def step_s(self, draft_length: int) -> float:
        return self.block(draft_length + 1) + draft_length * self.draft_token_s

    def tokens_per_s(self, acceptance: float, draft_length: int) -> float:
        return expected_tokens(acceptance, draft_length) / self.step_s(draft_length)

    def speedup(self, acceptance: float, draft_length: int) -> float:
        """Expected speedup over plain decoding (``draft_length = 0``)."""
        return self.tokens_per_s(acceptance, draft_length) / self.tokens_per_s(acceptance, 0)

    @property
    def draft_cost_ratio(self) -> float:
        """Leviathan's ``c``: a drafted token's cost over one plain decoding step."""
        return self.draft_token_s / self.block(1)

    def to_dict(self) -> dict:
        return {**asdict(self), "draft_cost_ratio": self.draft_cost_ratio}


class _CostAwareSchedule:
    """What both cost-aware schedules share (see the module doc): the cost model; the
    drafter's cost per drafted token as measured in this decoding (:meth:`observe_draft`),
    which replaces the model's ``draft_token_s`` from the first drafted step on; and the
    estimate ``p_i``, for every rank ``i`` below ``size``, that the rank-``i`` node (or
    draft position) is accepted.

    ``p_i`` is the recency-weighted share of verified steps with a rank-``i`` node whose
    node was accepted (each step weighted ``decay`` times the next one's), shrunk towards
    the estimate of rank ``i - 1`` by ``prior_weight`` pseudo-trials (rank 0 towards
    ``prior``). A rank never verified yet thus inherits the estimate of the rank before it,
    so the size grows one node at a time while the deepest verified rank still pays for
    itself, and shrinks when deep nodes stop being accepted. Evidence ages with every
    verified step, including a rank's evidence from before the size shrank below it: a
    rank left unverified drifts back towards the rank before it, so a size cut by a bad
    patch (a chain's drafts failing early in a new passage) is tried again later instead
    of staying cut for good.

    ``draft_length`` is the size ``N`` in ``1..size`` with the most
    ``(1 + sum(p_i for i < N)) / model.step_s(N)`` (at least 1: a step without drafts
    would teach the estimate nothing)."""

    def __init__(
        self,
        model: CostModel,
        size: int,
        size_name: str,
        prior: float,
        prior_weight: float,
        decay: float,
    ):
        self.size = inputs.count(size, size_name, minimum=1)
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior!r}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        if not prior_weight > 0.0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight!r}")
        self.model = model
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self._draft_seconds = 0.0
        self._drafted = 0.0
        self._hits = [0.0] * self.size  # weighted count of steps accepting rank i
        self._trials = [0.0] * self.size  # weighted count of steps verifying rank i
        self.draft_length = self._choose()

    def observe_draft(self, seconds: float, drafted: int) -> None:
        """Record a step that spent ``seconds`` drafting ``drafted`` tokens (or nodes)."""
        if drafted <= 0 or not seconds >= 0.0:
            return
        self._draft_seconds = self.decay * self._draft_seconds + seconds
        self._drafted = self.decay * self._drafted + drafted
        self.model = replace(self.model, draft_token_s=self._draft_seconds / self._drafted)

    @property
    def node_acceptance(self) -> list[float]:
        """The current estimate ``p_i`` for every rank ``i < size``."""
        out, before = [], self.prior
        for hits, trials in zip(self._hits, self._trials):
            before = (hits + self.prior_weight * before) / (trials + self.prior_weight)
            out.append(before)
        return out

    def expected_tokens(self, nodes: int) -> float:
        """Expected tokens of a step verifying the best ``nodes`` nodes (the verifier's
        own token included)."""
        return 1.0 + sum(self.node_acceptance[:nodes])

    def _choose(self) -> int:
        p = self.node_acceptance
        best, best_rate, tokens = 1, -1.0, 1.0
        for n in range(1, self.size + 1):
            tokens += p[n - 1]
            rate = tokens / self.model.step_s(n)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def _record(self, nodes: int, accepted: Sequence[int]) -> int:
        if nodes:  # every rank's evidence ages by a step, verified in it or not
            hit = set(accepted)
            for i in range(self.size):
                verified = i < nodes
                self._trials[i] = self.decay * self._trials[i] + verified
                self._hits[i] = self.decay * self._hits[i] + (verified and i in hit)
        self.draft_length = self._choose()
        return self.draft_length


class CostAwareDraftLength(_CostAwareSchedule):
    """Draft-length schedule for chains: ``draft_length`` is the ``k`` in
    ``1..max_draft_length`` with the most expected tokens per second, ``p_i`` (see
    :class:`_CostAwareSchedule`) being the share of steps that proposed draft position
    ``i`` and accepted it with every draft before it."""

    def __init__(
        self,
        model: CostModel,
        max_draft_length: int,
        *,
        prior: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.95,
    ):
        super().__init__(model, max_draft_length, "max_draft_length", prior, prior_weight, decay)

    @property
    def max_draft_length(self) -> int:
        return self.size

    def update(self, proposed: int, accepted: int) -> int:
        """Record a step that proposed ``proposed`` drafts and accepted the first
        ``accepted``; returns the next draft length."""
        if not 0 <= accepted <= proposed <= self.size:
            raise ValueError(
                f"a step cannot accept {accepted} of {proposed} drafts "
                f"(at most {self.size} proposed)"
            )
        return self._record(proposed, range(accepted))


class CostAwareTreeSize(_CostAwareSchedule):
    """Node-budget schedule for draft trees (see the module doc): ``draft_length`` is the
    ``N`` in ``1..max_nodes`` maximising ``(1 + sum(p_i for i < N)) / model.step_s(N)``,
    ``p_i`` (see :class:`_CostAwareSchedule`) being the share of verified trees whose
    rank-``i`` node was on the accepted path."""

    def __init__(
        self,
        model: CostModel,
        max_nodes: int,
        *,
        prior: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.95,
    ):
        super().__init__(model, max_nodes, "max_nodes", prior, prior_weight, decay)

    @property
    def max_nodes(self) -> int:
        return self.size

    def update_tree(self, nodes: int, accepted: Sequence[int]) -> int:
        """Record a verified tree of ``nodes`` nodes whose accepted path holds the nodes at
        ranks ``accepted`` (storage order); returns the next node budget."""
        if nodes > self.size or any(not 0 <= i < nodes for i in accepted):
            raise ValueError(
                f"a verified tree of {nodes} node(s) (at most {self.size}) cannot have "
                f"accepted ranks {list(accepted)}"
            )
        return self._record(nodes, accepted)
