"""Incremental paths against the dense / rolling oracles, well past sink + window.

Every path (token-by-token, chunked appends of random sizes, provisional blocks with
rollback) must give each position the oracle's context: max-abs logit difference <= 1e-4
in fp32, on the default real model (torch) and on tiny random models of two architectures
on every registered backend (the torch oracle is the reference for all of them). On torch
both forwards face them: the lean one (the default for steps and blocks of up to 16 tokens;
its counter shows it ran) and transformers' (``lean=False``, the reference).
"""

from __future__ import annotations

import random

import pytest
from oracle_cases import blocks_with_rollback, check_close, chunked, token_by_token

from kakeya_lab import SinkWindowConfig, reference

TOL = 1e-4
MODES = ["global", "rolling"]


def _lean_steps(v) -> int | None:
    """Forwards the verifier's lean path ran (None on a backend without one)."""
    return getattr(v.backend, "lean_steps", None)


def _paths_match_oracle(name, model, ids, config, want, record_tolerance, **options):
    rng = random.Random(0)
    lean = options.get("lean", None) is not False

    got, v = token_by_token(model, ids, config, **options)
    check_close(f"{name}/token-by-token", got, want, TOL, record_tolerance)
    assert v.cache_len == config.budget and v.history_len == len(ids)
    assert v.kv_live_bytes == v.kv_budget_bytes() > 0
    steps = _lean_steps(v)
    assert steps is None or steps == (len(ids) if lean else 0)

    got, last, v = chunked(model, ids, config, rng, **options)
    check_close(f"{name}/chunked", got, want, TOL, record_tolerance)
    check_close(f"{name}/chunked append", last, want[-1], TOL, record_tolerance)
    steps = _lean_steps(v)
    assert steps is None or (steps > 0) == lean

    got, v = blocks_with_rollback(model, ids, config, rng, **options)
    assert v.history_token_ids == ids
    check_close(f"{name}/blocks+rollback", got, want, TOL, record_tolerance)
    steps = _lean_steps(v)
    assert steps is None or (steps > len(ids) // 8) == lean


# The fast loop's real-model oracle case is tests/test_torch_lean.py's default-model test.
@pytest.mark.parametrize("forward", ["lean", "transformers"])
@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.slow
def test_paths_match_oracle_past_the_window(
    default_model, text_ids, mode, forward, record_tolerance
):
    config = SinkWindowConfig(sink=4, window=28, positions=mode)
    ids = text_ids[: 4 * config.budget]  # several times longer than sink + window
    want = reference.oracle_logits(default_model.model, ids, config)
    name = f"default/{mode}/{forward}"
    lean = None if forward == "lean" else False  # None: the default, lean where it applies
    _paths_match_oracle(name, default_model.model, ids, config, want, record_tolerance, lean=lean)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.slow), "qwen3"])
def test_every_backend_matches_the_oracle_past_the_window(
    backend, tiny_backends, tiny_on, arch, mode, record_tolerance
):
    """The same paths on each registered backend's copy of a tiny random model (torch:
    through both forwards)."""
    model = tiny_on(arch, backend)
    config = SinkWindowConfig(sink=4, window=28, positions=mode)
    ids = [random.Random(3).randrange(1000, 40000) for _ in range(4 * config.budget)]
    want = reference.oracle_logits(tiny_backends[arch]["torch"], ids, config)
    for lean in (None, False) if backend == "torch" else (None,):
        name = f"tiny-{arch}/{mode}/{backend}" + ("" if lean is None else "/transformers")
        _paths_match_oracle(name, model, ids, config, want, record_tolerance, lean=lean)


@pytest.mark.slow
def test_rolling_oracle_equals_dense_before_the_cache_fills(default_model, text_ids):
    """The rolling rule as written (token by token: ``rolling_logits`` is held to it below)
    agrees with the dense oracle up to the budget and really differs past it."""
    config = SinkWindowConfig(sink=4, window=28, positions="rolling")
    n = config.budget
    rolling = reference.RollingReference(default_model.model, config).extend(text_ids[: 2 * n])
    dense = reference.dense_logits(
        default_model.model, text_ids[:n], SinkWindowConfig(4, 28, "global")
    )
    assert (rolling[:n] - dense).abs().max().item() <= TOL
    global_past = reference.dense_logits(
        default_model.model, text_ids[: 2 * n], SinkWindowConfig(4, 28, "global")
    )
    assert (rolling[n:] - global_past[n:]).abs().max().item() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize(("sink", "window", "n"), [(4, 28, 96), (2, 6, 40), (1, 1, 24)])
def test_one_forward_rolling_oracle_is_token_by_token_decoding(
    default_model, text_ids, sink, window, n
):
    """``rolling_logits``' one forward gives what the rolling rule as written gives, decoded
    a token at a time (``RollingReference``), far past the budget; the model's attention is
    its own again afterwards. The rule really differs from global positions there (the
    sinks' distances; a tiny random model's near-uniform attention cannot tell them apart)."""
    model = default_model.model
    config = SinkWindowConfig(sink=sink, window=window, positions="rolling")
    ids = text_ids[:n]
    stepped = reference.RollingReference(model, config).extend(ids)
    attention = model.config._attn_implementation
    assert (reference.rolling_logits(model, ids, config) - stepped).abs().max().item() <= TOL
    assert model.config._attn_implementation == attention
    global_positions = reference.dense_logits(model, ids, SinkWindowConfig(sink, window))
    assert (stepped - global_positions).abs().max().item() > 1e-2


def test_dense_oracle_refuses_rolling_past_the_budget(tiny_model, text_ids):
    config = SinkWindowConfig(sink=2, window=6, positions="rolling")
    with pytest.raises(ValueError, match="rolling_logits"):
        reference.dense_logits(tiny_model.model, text_ids[:20], config)


def test_window_mask_is_not_the_causal_mask(default_model, text_ids):
    """Sanity: past the window the sink-window oracle differs from full attention."""
    ids = text_ids[:80]
    windowed = reference.dense_logits(default_model.model, ids, SinkWindowConfig(4, 28))
    full = reference.dense_logits(default_model.model, ids, SinkWindowConfig(0, None))
    assert (windowed[:32] - full[:32]).abs().max().item() <= TOL
    assert (windowed[40:] - full[40:]).abs().max().item() > 1e-2
