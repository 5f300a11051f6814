"""The incremental n-gram proposer: the drafts of an exhaustive search, at a per-step cost
that does not grow with the history."""

from __future__ import annotations

import random

import pytest

from kakeya_lab.proposers import NgramProposer


def brute_force(context, draft_length, sizes=(3, 2, 1), max_lookback=None):
    """The latest earlier occurrence of the last n-gram (largest n first), by scanning."""
    ctx = list(context) if max_lookback is None else list(context)[-max_lookback:]
    if draft_length < 1:
        return []
    for n in sorted(sizes, reverse=True):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start : start + n] == suffix:
                return ctx[start + n : start + n + draft_length]
    return []


def edits(rng: random.Random, steps: int, vocab: int, unrelated: bool, max_rewrite: int):
    """A context evolving as a session's does (grow, roll back, regrow) plus, if
    ``unrelated``, rare rewrites into an unrelated history (another session)."""
    ctx: list[int] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.6 or len(ctx) < 4:
            ctx = ctx + [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        elif r < 0.8:
            ctx = ctx[: len(ctx) - rng.randint(1, min(len(ctx), 8))]
        elif r < 0.95:  # rollback then other tokens (within the proposer's contract)
            ctx = ctx[: len(ctx) - rng.randint(1, min(len(ctx), max_rewrite))] + [
                rng.randrange(vocab) for _ in range(3)
            ]
        elif unrelated:
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 80))]
        yield ctx


@pytest.mark.parametrize(
    "sizes,max_lookback,check_tokens",
    [
        ((3, 2, 1), None, 64),
        ((4, 2), None, 8),
        ((3, 2, 1), 20, 64),
        ((1,), 7, 3),
        ((5, 3, 1), None, 2),
    ],
)
def test_same_drafts_as_the_exhaustive_search(sizes, max_lookback, check_tokens):
    rng = random.Random(hash((sizes, max_lookback, check_tokens)) % 1000)
    proposer = NgramProposer(sizes, max_lookback=max_lookback, check_tokens=check_tokens)
    hits = 0
    for ctx in edits(
        rng,
        600,
        vocab=6,
        unrelated=check_tokens >= 32,
        max_rewrite=max(1, min(6, check_tokens // 2)),
    ):
        k = rng.randint(0, 6)
        got = proposer.propose(ctx, k).tokens
        assert got == brute_force(ctx, k, sizes, max_lookback), (ctx, k)
        hits += bool(got)
    assert hits > 100  # the comparison is not only over empty drafts


def test_per_step_work_does_not_grow_with_history():
    rng = random.Random(0)

    def steady_work(length: int) -> int:
        proposer = NgramProposer()
        ctx = [rng.randrange(50) for _ in range(length)]
        proposer.propose(ctx, 4)
        worst = 0
        for _ in range(50):  # one speculative step: a few accepted tokens, a rollback now and then
            ctx.extend(rng.randrange(50) for _ in range(rng.randint(1, 3)))
            before = proposer.work
            proposer.propose(ctx, 4)
            worst = max(worst, proposer.work - before)
        return worst

    short, long = steady_work(200), steady_work(20_000)
    assert long <= short <= 64 + 1 + 3 * 3 + 3  # checked tail, the check, indexing, lookups
    # control: an unrelated history costs its whole length (the counter does count)
    proposer = NgramProposer()
    proposer.propose([rng.randrange(50) for _ in range(20_000)], 4)
    before = proposer.work
    proposer.propose([rng.randrange(50) for _ in range(20_000)], 4)
    assert proposer.work - before > 20_000
