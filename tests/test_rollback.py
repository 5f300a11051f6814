"""Random interleavings of append / forward_block / commit / rollback, across wrap-around."""

from __future__ import annotations

import random

import pytest
import torch
from oracle_cases import random_interleavings

from kakeya_lab import SinkWindowConfig, Verifier

TOL = 1e-4


@pytest.mark.parametrize("mode", [pytest.param("global", marks=pytest.mark.slow), "rolling"])
@pytest.mark.slow
def test_random_interleavings_match_oracle_and_replay(tiny_model, mode, record_tolerance):
    """Every forward of a random append/forward_block/commit/rollback sequence is checked:
    global mode against the dense masked forward, rolling mode against the single-token
    reference (kept incrementally: committed tokens once, each open block on a fork)."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=10, positions=mode)
    rng = random.Random(1234 if mode == "global" else 99)
    v = Verifier(model, config, prefill_chunk=4)
    vocab = v.vocab_size
    worst, checks = random_interleavings(v, model, rng, 400, dense=mode == "global")
    assert v.history_len > 5 * config.budget, "the run must wrap the window many times"
    record_tolerance(f"tiny-qwen3/{mode}/random interleavings ({checks} checks)", worst)
    assert worst <= TOL

    # A fresh replay of the committed history holds the same entries and predicts the same.
    v.rollback()
    fresh = Verifier(model, config)
    last_live = fresh.append(v.history_token_ids)
    assert fresh.cached_token_ids == v.cached_token_ids
    assert fresh.cached_positions() == v.cached_positions()
    probe = [rng.randrange(vocab) for _ in range(5)]
    diff = (v.forward_block(probe) - fresh.forward_block(probe)).abs().max().item()
    assert diff <= TOL
    assert last_live.shape == (vocab,)


def test_rollback_after_wrap_keeps_every_committed_entry(tiny_model):
    model = tiny_model.model
    config = SinkWindowConfig(sink=3, window=8)
    v = Verifier(model, config)
    rng = random.Random(5)
    ids = [rng.randrange(v.vocab_size) for _ in range(50)]
    v.append(ids)
    keys_before = [layer.keys[:, :, : v.cache_len].clone() for layer in v.cache.layers]
    cached_before = v.cached_token_ids
    # a block longer than the window: if it evicted on forward, rollback could not restore
    v.forward_block([rng.randrange(v.vocab_size) for _ in range(20)])
    v.rollback()
    assert v.cached_token_ids == cached_before
    for layer, before in zip(v.cache.layers, keys_before):
        assert torch.equal(layer.keys[:, :, : v.cache_len], before)


def test_kv_live_bytes_grows_then_equals_the_analytic_budget(default_model, text_ids):
    model = default_model.model
    cfg = model.config
    config = SinkWindowConfig(sink=4, window=60)
    budget = config.budget * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 2
    v = Verifier(model, config)
    series = []
    for i in range(0, 160, 8):
        v.append(text_ids[i : i + 8])
        series.append(v.kv_live_bytes)
    assert all(b > 0 for b in series)
    filled = [b for b, n in zip(series, range(8, 161, 8)) if n >= config.budget]
    growing = series[: len(series) - len(filled)]
    assert all(a < b for a, b in zip(growing, growing[1:])), growing
    assert growing[-1] < budget
    assert filled and all(b == budget for b in filled), (filled, budget)
    assert v.cache.kv_budget_bytes() == budget


def test_bad_cache_configs_are_clear_errors():
    for bad in [dict(sink=-1), dict(window=0), dict(positions="absolute"), dict(sink=1.5)]:
        with pytest.raises(ValueError):
            SinkWindowConfig(**bad)


def test_verifier_rejects_bad_token_ids_and_loses_nothing(tiny_model):
    v = Verifier(tiny_model.model, SinkWindowConfig(sink=2, window=6))
    v.append([1, 2, 3])
    for bad in [[], [-1], [v.vocab_size], [1, 2, v.vocab_size + 5]]:
        with pytest.raises(ValueError):
            v.append(bad)
    with pytest.raises(TypeError):
        v.append("hello")
    assert v.history_token_ids == [1, 2, 3]
    v.forward_block([4, 5])
    with pytest.raises(RuntimeError, match="provisional"):
        v.append([6])
    with pytest.raises(ValueError):
        v.commit(3)
    v.commit(1)
    assert v.history_token_ids == [1, 2, 3, 4]
