"""Block padding: a chain block of ``n`` tokens scored at a larger size that this machine's
BLAS multiplies faster (``kakeya_lab.cost_model.block_padding``). The padded verifier must
give every real row the oracle's logits, hold exactly the cache an unpadded verifier holds,
and keep greedy speculative decoding equal to plain decoding, across eviction and rollback.
Mechanics on the tiny random model; the speed is measured by ``benchmarks/verify_cost.py``
and notebook 35 (``pad_blocks``)."""

from __future__ import annotations

import random

import pytest

from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.cost_model import block_padding
from kakeya_lab.data import domain_conversations
from kakeya_lab.proposers import NgramProposer
from kakeya_lab.reference import oracle_logits

PAD_ALL = {n: n + 3 for n in range(2, 14)}  # every block padded by three copies


def test_the_plan_takes_the_cheapest_larger_size_beyond_a_margin():
    ms = {1: 9.0, 2: 20.0, 3: 31.0, 4: 16.0, 5: 16.0, 6: 22.0, 7: 33.0, 8: 16.5, 9: 18.0}
    plan = block_padding({n: [t, t + 0.1, t - 0.1] for n, t in ms.items()})
    assert plan == {1: 1, 2: 4, 3: 4, 4: 4, 5: 5, 6: 8, 7: 8, 8: 8, 9: 9}
    # within the margin of its own size, a block stays as it is
    assert block_padding({2: [20.0], 3: [19.5]}) == {2: 2, 3: 3}
    assert block_padding({2: [20.0], 3: [19.5]}, margin=0.0) == {2: 3, 3: 3}
    assert block_padding({1: [50.0], 2: [10.0]})[1] == 1  # a plain step is never padded


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.slow
def test_padded_blocks_give_the_oracle_rows_and_the_unpadded_cache(
    tiny_model, mode, record_tolerance
):
    """Random blocks, partly committed or rolled back, over a history that wraps the
    window many times; the padded and the unpadded verifier run in lockstep."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=6, positions=mode)
    rng = random.Random(5)
    vocab = model.config.vocab_size
    padded, plain = Verifier(model, config, block_padding=PAD_ALL), Verifier(model, config)
    for v in (padded, plain):
        v.trace_hidden(64)
        v.append([7, 8, 9])
    worst = 0.0
    for _ in range(25):
        block = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
        if rng.random() < 0.3:  # first a block that the next one extends
            first = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            padded.forward_block(first), plain.forward_block(first)
            assert padded.backend.pending_len == plain.backend.pending_len == len(first)
        else:
            first = []
        got, want = padded.forward_block(block), plain.forward_block(block)
        tokens = plain.history_token_ids + first + block
        oracle = oracle_logits(model, tokens, config)[-len(block) :]
        block = first + block
        assert padded.backend.pending_len == plain.backend.pending_len == len(block)
        assert got.shape == want.shape == oracle.shape
        worst = max(worst, float((got - oracle).abs().max()), float((got - want).abs().max()))
        keep = rng.randint(0, len(block))
        if rng.random() < 0.2:
            padded.rollback(), plain.rollback()
        else:
            padded.commit(keep), plain.commit(keep)
        assert padded.pending_len == plain.pending_len == 0
        assert padded.cached_token_ids == plain.cached_token_ids
        assert padded.cached_positions() == plain.cached_positions()
        assert padded.kv_live_bytes == plain.kv_live_bytes
        n = padded.history_len
        held = [p for p in range(max(0, n - 8), n)]
        ids = [padded.history_token_ids[p] for p in held]
        rows = padded.trace.features(held, ids), plain.trace.features(held, ids)
        assert rows[0] is not None and rows[1] is not None  # the real rows, no padding
        worst = max(worst, float((rows[0] - rows[1]).abs().max()))
    assert padded.history_len > 5 * config.budget, "the run must wrap the window many times"
    record_tolerance(f"tiny-qwen3/{mode}/padded blocks vs oracle and unpadded", worst)
    assert worst <= 1e-4


def test_padded_greedy_speculative_decoding_equals_plain_past_eviction(tiny_model):
    """Through the session runtime and the benchmark: ``ngram@padK`` arms (blocks padded
    by the plan measured before the arms) emit exactly the plain stream."""
    config = SinkWindowConfig(sink=2, window=20)
    run = run_speculative(
        tiny_model,
        {"ngram": NgramProposer},
        domain_conversations("code", "dev", limit=1),
        SpeculativeSettings.for_cache(
            config,
            draft_lengths=(2, 5),
            turns=2,
            max_new_tokens=24,
            cost_repeats=1,
            pad_blocks=True,
        ),
        progress=False,
    )
    arms = list(run.summary["arm"])
    assert arms == ["plain", "ngram@2", "ngram@5", "ngram@pad2", "ngram@pad5"]
    assert greedy_streams_identical(run.turns)
    assert run.turns["history_len"].max() > config.budget
    assert run.block_padding is not None and sorted(run.block_padding) == list(range(1, 7))
    assert all(m >= n for n, m in run.block_padding.items()) and run.block_padding[1] == 1
    padded = run.turns[run.turns["arm"] == "ngram@pad5"]
    assert (padded["proposer"] == "ngram (padded blocks)").all()
    with pytest.raises(ValueError, match="measure_cost"):
        run_speculative(
            tiny_model,
            {"ngram": NgramProposer},
            domain_conversations("code", "dev", limit=1),
            SpeculativeSettings.for_cache(
                config, draft_lengths=(2,), measure_cost=False, pad_blocks=True
            ),
        )


def test_bad_padding_plans_are_refused(tiny_model, tiny_on):
    config = SinkWindowConfig(sink=2, window=6)
    for bad in ({3: 2}, {0: 4}, {2: 4.5}):
        with pytest.raises(ValueError, match="block_padding"):
            Verifier(tiny_model.model, config, block_padding=bad)
    with pytest.raises(ValueError, match="torch backend only"):
        Verifier(tiny_on("qwen3", "mlx"), config, block_padding={2: 4})
