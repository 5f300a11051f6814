"""The suffix proposer: drafts equal to a from-scratch count over the sequences, an index
that follows the session's edits, a per-step cost independent of the history, replies
shared across sessions, and greedy speculative output equal to plain decoding past
eviction on a real model."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from test_ngram import edits

from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.proposers import make_proposer
from kakeya_lab.proposers.registry import check_proposer_spec
from kakeya_lab.proposers.suffix import SharedReplies, SuffixIndex, SuffixProposer
from kakeya_lab.session import SessionStore, collect_reply
from kakeya_lab.speculative import plain_decode, speculative_decode


def brute_counts(sequences, ctx):
    """How often each token followed ``ctx`` in ``sequences``, by scanning; ties go to the
    token whose latest occurrence after ``ctx`` came last (own history after shared)."""
    counts: Counter = Counter()
    last: dict[int, tuple[int, int]] = {}  # (rank, position): own history ranks last
    n = len(ctx)
    for rank, seq in enumerate(sequences):
        for end in range(n, len(seq)):
            if list(seq[end - n : end]) == list(ctx):
                counts[seq[end]] += 1
                last[seq[end]] = (rank, end)
    return counts, last


def brute_draft(history, shared, draft_length, *, max_depth, min_probability, factor):
    """The drafting rule of the module docstring, computed by scanning the raw sequences."""
    seqs = list(shared) + [history]

    def match(tail):
        for n in range(min(max_depth, len(tail)), 0, -1):
            counts, last = brute_counts(seqs, tail[len(tail) - n :])
            if counts:
                return n, counts, last
        return 0, None, None

    tail = list(history)[-max_depth:]
    matched, counts, last = match(tail)
    cap = min(draft_length, math.ceil(factor * matched)) if matched else 0
    out, p = [], 1.0
    while counts and len(out) < cap:
        token = max(counts, key=lambda t: (counts[t], last[t]))
        p *= counts[token] / sum(counts.values())
        if p < min_probability:
            break
        out.append(token)
        tail = (tail + [token])[-max_depth:]
        _, counts, last = match(tail)
    return out


@pytest.mark.parametrize("max_depth,min_probability,factor", [(4, 0.1, 2.0), (2, 0.0, 1.0)])
def test_drafts_equal_a_scan_of_the_history_under_edits(max_depth, min_probability, factor):
    rng = random.Random(max_depth)
    proposer = SuffixProposer(
        max_depth=max_depth,
        min_probability=min_probability,
        max_spec_factor=factor,
        check_tokens=16,
    )
    drafted = 0
    for ctx in edits(rng, 400, vocab=5, unrelated=True, max_rewrite=6):
        length = rng.randint(1, 6)
        got = proposer.propose(ctx, length).tokens
        want = brute_draft(
            ctx,
            [],
            length,
            max_depth=max_depth,
            min_probability=min_probability,
            factor=factor,
        )
        if got != want:  # ties between equal counts may differ only in recency order
            counts, _ = brute_counts([ctx], ctx[-max_depth:])
            pytest.fail(f"context {ctx}: drafted {got}, scan says {want} ({counts})")
        drafted += bool(got)
        fresh = SuffixIndex(max_depth)
        for position in range(1, len(ctx)):
            fresh.add_at(ctx, position)
        assert proposer.index.ends == fresh.ends  # the index follows every edit
    assert drafted > 100  # not a comparison of empty drafts


def test_shared_replies_reach_another_session():
    shared = SharedReplies(max_depth=4)
    a = SuffixProposer(max_depth=4, shared=shared)
    b = SuffixProposer(max_depth=4, shared=shared)
    reply = [10, 11, 12, 13, 14, 15]
    a.propose([1, 2, 3], 4)
    a.observe_reply(reply)
    assert shared.replies == 1
    # b never saw the reply in its own history, yet continues its opening from it
    assert b.propose([7, 8, 10, 11], 4).tokens == [12, 13, 14, 15]
    lone = SuffixProposer(max_depth=4)
    assert lone.propose([7, 8, 10, 11], 4).tokens == []
    want = brute_draft([7, 8, 10, 11], [reply], 4, max_depth=4, min_probability=0.1, factor=2.0)
    assert want == [12, 13, 14, 15]


def test_per_step_work_does_not_grow_with_history():
    rng = random.Random(0)

    def steady_work(length: int) -> int:
        proposer = SuffixProposer(max_depth=8)
        ctx = [rng.randrange(50) for _ in range(length)]
        proposer.propose(ctx, 4)
        worst = 0
        for _ in range(50):
            ctx = ctx[: len(ctx) - rng.randint(0, 2)]  # a rejected draft's rollback
            ctx.extend(rng.randrange(50) for _ in range(rng.randint(1, 3)))
            before = proposer.work
            proposer.propose(ctx, 4)
            worst = max(worst, proposer.work - before)
        return worst

    short, long = steady_work(300), steady_work(20_000)
    assert long <= short <= 5 * 8  # at most (2 removed + 3 added) positions x depth
    control = SuffixProposer(max_depth=8)  # a new history costs its whole length
    control.propose([rng.randrange(50) for _ in range(5_000)], 4)
    assert control.work > 5_000


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixProposer(max_depth=0)
    with pytest.raises(ValueError, match="min_probability"):
        SuffixProposer(min_probability=1.5)
    with pytest.raises(ValueError, match="max_spec_factor"):
        SuffixProposer(max_spec_factor=0)
    with pytest.raises(TypeError, match="SharedReplies"):
        SuffixProposer(shared=SuffixIndex())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="suffix:8"):
        check_proposer_spec("suffix:deep")
    check_proposer_spec("suffix:6")


@pytest.mark.slow
@pytest.mark.parametrize("draft_length", [1, 4, 8])
def test_greedy_speculation_equals_plain_decoding_past_eviction(
    default_model, text_ids, draft_length
):
    config = SinkWindowConfig(sink=4, window=36)
    prompt = text_ids[:150]  # the text repeats: the suffix index has matches to draft from
    v = Verifier(default_model.model, config)
    want = list(plain_decode(v, v.append(prompt), max_new_tokens=48))
    proposer = make_proposer("suffix", default_model.model, config)
    assert isinstance(proposer, SuffixProposer)
    v = Verifier(default_model.model, config)
    decoder = speculative_decode(
        v, v.append(prompt), proposer, max_new_tokens=48, draft_length=draft_length
    )
    got = [t for t in decoder if isinstance(t, int)]
    assert got == want
    assert v.history_token_ids == prompt + want
    assert v.cache_len == config.budget  # evicted throughout
    assert sum(s.proposed for s in decoder.steps) > 0  # it did draft


@pytest.mark.slow
def test_a_store_shares_replies_across_sessions(default_model):
    config = SinkWindowConfig(sink=4, window=60)
    store = SessionStore(default_model.model, config)
    shared = SharedReplies()
    tok = default_model.tokenizer
    prompt = tok("List the days of the week, one per line.")["input_ids"]
    replies = []
    for _ in range(2):
        sid = store.create()
        store.append(sid, prompt)
        proposer = SuffixProposer(shared=shared)
        replies.append(collect_reply(store.generate(sid, 40, proposer=proposer, draft_length=4)))
        store.close(sid)
    assert shared.replies == 2
    plain = store.create()
    store.append(plain, prompt)
    want = collect_reply(store.generate(plain, 40)).token_ids
    assert replies[0].token_ids == replies[1].token_ids == want  # lossless both times
    # the second session drafted from the first one's reply and had more accepted
    assert replies[1].done.counts.accepted > replies[0].done.counts.accepted
