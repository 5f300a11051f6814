"""Cost-aware drafting: the measured block cost, the expected-tokens model (Leviathan's formula
when blocks cost as much as one token), the schedule's choices, and lossless decoding."""

from __future__ import annotations

import random

import pytest

from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.bench.speculative import leviathan_speedup
from kakeya_lab.cost_model import (
    BlockCost,
    CostAwareDraftLength,
    CostAwareTreeSize,
    CostModel,
    expected_tokens,
    fit_block_cost,
    measure_block_cost,
)
from kakeya_lab.proposers import NgramProposer
from kakeya_lab.proposers.trees import SuffixTreeProposer
from kakeya_lab.session import SessionStore, collect_reply
from kakeya_lab.speculative import plain_decode, speculative_decode


def test_fit_recovers_a_line_through_noisy_medians():
    rng = random.Random(0)
    timings = {}
    for n in range(1, 10):  # 5 clean samples and 2 slow outliers per size, shuffled
        samples = [0.02 + 0.003 * n + extra for extra in [0.0] * 5 + [0.05, 0.2]]
        rng.shuffle(samples)
        timings[n] = samples
    cost = fit_block_cost(timings)  # the medians are exact: outliers are a minority
    assert cost.fixed_s == pytest.approx(0.02, abs=1e-12)
    assert cost.per_token_s == pytest.approx(0.003, abs=1e-12)
    with pytest.raises(ValueError, match="two block sizes"):
        fit_block_cost({3: [0.1, 0.2]})


@pytest.mark.parametrize("a", [0.0, 0.3, 0.77, 1.0])
def test_expected_tokens_is_the_geometric_sum(a):
    for k in range(8):
        assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))


def test_a_flat_block_cost_gives_leviathans_formula():
    model = CostModel(BlockCost(fixed_s=0.1, per_token_s=0.0), draft_token_s=0.02)
    assert model.draft_cost_ratio == pytest.approx(0.2)
    for a in (0.2, 0.6, 0.9):
        for k in (1, 3, 6):
            assert model.speedup(a, k) == pytest.approx(leviathan_speedup(a, k, 0.2))


def test_the_schedule_follows_acceptance():
    model = CostModel(BlockCost(fixed_s=0.05, per_token_s=0.005), draft_token_s=0.002)
    schedule = CostAwareDraftLength(model, max_draft_length=8)
    for _ in range(30):  # every draft accepted
        schedule.update(schedule.draft_length, schedule.draft_length)
    assert min(schedule.node_acceptance) > 0.9 and schedule.draft_length == 8
    for _ in range(60):  # every draft rejected at once
        schedule.update(schedule.draft_length, 0)
    assert schedule.node_acceptance[0] < 0.1 and schedule.draft_length == 1  # never below 1
    with pytest.raises(ValueError, match="decay"):
        CostAwareDraftLength(model, 4, decay=0.0)
    with pytest.raises(ValueError, match="max_draft_length"):
        CostAwareDraftLength(model, 0)
    with pytest.raises(ValueError, match="cannot accept 3 of 2"):
        schedule.update(2, 3)


# Medians of a verifier block of 1..9 tokens on the 2-core Zen 3 (ms): its products share each
# weight's unpacking between up to 8 rows, so a 9th row costs a step, not a slope.
ZEN3_BLOCK_MS = {1: 18.5, 2: 22.5, 3: 24.0, 4: 29.2, 5: 37.2, 6: 39.8, 7: 44.0, 8: 44.0, 9: 60.3}


def test_the_block_cost_is_the_measured_staircase_and_the_line_beyond_it():
    cost = fit_block_cost({n: [ms / 1e3, ms / 1e3 + 0.5] for n, ms in ZEN3_BLOCK_MS.items()})
    for n, ms in ZEN3_BLOCK_MS.items():  # the median of each size
        assert cost(n) == pytest.approx(ms / 1e3 + 0.25)
    assert cost(12) == pytest.approx(cost.line(12)) and cost(0) == pytest.approx(cost.line(0))
    gappy = BlockCost(0.0, 0.0, measured=((1, 0.01), (4, 0.04)))
    assert gappy(2) == pytest.approx(0.02) and gappy(3) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="ascending"):
        BlockCost(0.0, 0.0, measured=((4, 0.04), (1, 0.01)))


def test_the_chain_schedule_finds_the_step_in_the_block_cost():
    # Drafts that land whole or fail at once (a suffix match's), 4 steps in 5 landing:
    # every draft position is accepted 80% of the time, so k drafts bring 1 + 0.8 k
    # tokens. On the measured staircase 7 drafts (8 rows) pay best; the line through the
    # same medians hides the step at 9 rows and would take 8.
    timings = {n: [ms / 1e3] for n, ms in ZEN3_BLOCK_MS.items()}
    staircase = CostModel(fit_block_cost(timings), draft_token_s=0.0)
    line = CostModel(BlockCost(staircase.block.fixed_s, staircase.block.per_token_s), 0.0)

    def settle(model: CostModel) -> CostAwareDraftLength:
        schedule = CostAwareDraftLength(model, max_draft_length=8)
        for step in range(200):
            k = schedule.draft_length
            schedule.update(k, 0 if step % 5 == 4 else k)
        return schedule

    on_staircase, on_line = settle(staircase), settle(line)
    assert on_staircase.draft_length == 7
    assert on_line.draft_length == 8
    assert on_staircase.node_acceptance[0] == pytest.approx(0.8, abs=0.05)
    # the rates it compared, from the measured block costs
    assert on_staircase.expected_tokens(7) / staircase.step_s(7) > max(
        on_staircase.expected_tokens(k) / staircase.step_s(k) for k in (1, 2, 3, 4, 5, 6, 8)
    )


def test_a_draft_length_cut_by_a_bad_patch_grows_back():
    # The chain of the test above settles at 7 drafts; a patch where every draft fails at
    # once cuts it to 1, and when drafts land again it must find 7 again, although the
    # deeper positions were last seen failing.
    timings = {n: [ms / 1e3] for n, ms in ZEN3_BLOCK_MS.items()}
    schedule = CostAwareDraftLength(CostModel(fit_block_cost(timings), 0.0), max_draft_length=8)

    def run(steps: int, lands) -> list[int]:
        lengths = []
        for step in range(steps):
            k = schedule.draft_length
            schedule.update(k, k if lands(step) else 0)
            lengths.append(schedule.draft_length)
        return lengths

    assert run(200, lambda step: step % 5 != 4)[-1] == 7
    assert run(60, lambda step: False)[-1] == 1
    regrown = run(200, lambda step: step % 5 != 4)
    assert regrown[-1] == 7 and set(regrown[-50:]) <= {6, 7}


def test_measured_block_cost_leaves_the_verifier_unchanged(tiny_model, text_ids):
    v = Verifier(tiny_model.model, SinkWindowConfig(sink=2, window=14))
    v.append(text_ids[:40])
    before = (v.history_token_ids, v.cache_len)
    timings = measure_block_cost(v, sizes=(1, 3, 5), repeats=2)
    assert sorted(timings) == [1, 3, 5] and all(len(t) == 2 for t in timings.values())
    assert (v.history_token_ids, v.cache_len) == before and v.pending_len == 0
    assert all(t > 0 for ts in timings.values() for t in ts)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make_proposer, schedule",
    [(NgramProposer, CostAwareDraftLength), (SuffixTreeProposer, CostAwareTreeSize)],
    ids=["chain", "tree"],
)
def test_cost_aware_decoding_is_lossless_past_eviction(
    default_model, text_ids, make_proposer, schedule
):
    config = SinkWindowConfig(sink=4, window=36)
    prompt = text_ids[:90]
    v = Verifier(default_model.model, config)
    want = list(plain_decode(v, v.append(prompt), max_new_tokens=48))
    v = Verifier(default_model.model, config)
    next_logits = v.append(prompt)
    model = CostModel(fit_block_cost(measure_block_cost(v, sizes=(1, 4, 8), repeats=1)), 0.0)
    decoder = speculative_decode(
        v, next_logits, make_proposer(), max_new_tokens=48, draft_length=12, cost_model=model
    )
    got = [t for t in decoder if isinstance(t, int)]
    assert got == want and v.cache_len == config.budget
    assert isinstance(decoder.schedule, schedule)
    assert all(s.proposed <= 12 for s in decoder.steps)
    assert 1 <= decoder.schedule.draft_length <= 12
    assert any(s.proposed for s in decoder.steps)
    assert decoder.schedule.model.draft_token_s > 0.0  # measured while decoding


def test_bad_schedules_are_clear_errors(tiny_model):
    store = SessionStore(tiny_model.model, SinkWindowConfig(sink=2, window=14))
    sid = store.create()
    store.append(sid, [1, 2, 3])
    model = CostModel(BlockCost(0.01, 0.001), 0.0)
    with pytest.raises(ValueError, match="give one"):
        store.generate(
            sid, 4, proposer=NgramProposer(), adaptive_draft_length=True, cost_model=model
        )
    with pytest.raises(TypeError, match="CostModel"):
        store.generate(sid, 4, proposer=NgramProposer(), cost_model=0.5)  # type: ignore[arg-type]
    # nothing was lost: the session still generates
    assert len(collect_reply(store.generate(sid, 3)).token_ids) == 3


def test_tree_size_follows_which_ranks_get_accepted():
    # A node costs 4% of the step's fixed cost: worth verifying while its chance of being
    # on the accepted path stays above about tokens-per-step x 0.04.
    model = CostModel(BlockCost(fixed_s=0.1, per_token_s=0.004), draft_token_s=0.0)
    s = CostAwareTreeSize(model, max_nodes=16, prior=0.02)
    start = s.draft_length
    assert 1 <= start < 16
    # every verified node is accepted: the budget grows, a node at a time, to the cap
    for _ in range(40):
        s.update_tree(s.draft_length, list(range(s.draft_length)))
    assert s.draft_length == 16
    # only the first 6 ranks are ever accepted: the budget settles at 6
    for _ in range(80):
        s.update_tree(s.draft_length, list(range(min(s.draft_length, 6))))
    assert s.draft_length == 6
    assert s.expected_tokens(6) == pytest.approx(7.0, abs=0.15)  # the prior still weighs a little
    # from now on only rank 0 is ever accepted: deeper ranks stop paying, the budget shrinks
    for _ in range(120):
        s.update_tree(s.draft_length, [0])
    assert s.draft_length <= 2
    p = s.node_acceptance
    assert p[0] > 0.85 and p[1] < 0.1  # (shrunk towards the prior: 2 of ~22 weighted trials)
    # a node costing 5x the step's fixed cost pays only if nearly sure: at 50% it does not
    dear = CostAwareTreeSize(CostModel(BlockCost(0.01, 0.05), 0.0), max_nodes=8, prior=0.9)
    assert dear.draft_length == 8
    for j in range(60):
        dear.update_tree(dear.draft_length, list(range(dear.draft_length)) if j % 2 else [])
    assert dear.draft_length == 1
    with pytest.raises(ValueError, match="accepted ranks"):
        s.update_tree(2, [5])
    with pytest.raises(ValueError, match="max_nodes"):
        CostAwareTreeSize(model, max_nodes=0)


def test_schedules_measure_the_drafters_cost():
    s = CostAwareDraftLength(CostModel(BlockCost(0.05, 0.005), draft_token_s=0.0), 8, decay=1.0)
    s.observe_draft(0.03, 3)
    s.observe_draft(0.01, 1)
    assert s.model.draft_token_s == pytest.approx(0.01)
    s.observe_draft(0.5, 0)  # nothing drafted: nothing learnt
    assert s.model.draft_token_s == pytest.approx(0.01)
