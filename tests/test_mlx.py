"""The MLX backend against the oracles (MLX dense masked forward and the torch references).

MLX-specific checks on mlx[cpu] (the tiny-model oracle paths and greedy losslessness run on
every registered backend in tests/test_oracle.py and tests/test_backends.py): the MLX dense
oracle, SmolLM2's paths, random interleavings across many wraps, both position modes;
rollback after a wrap; torch vs MLX greedy streams.
Tolerances (fp32): tiny random models 1e-4, SmolLM2 1e-3.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("mlx_lm")

from oracle_cases import (  # noqa: E402
    blocks_with_rollback,
    check_close,
    chunked,
    random_interleavings,
    token_by_token,
)

from kakeya_lab import SinkWindowConfig, Verifier, reference  # noqa: E402
from kakeya_lab.backends.mlx_backend import load_mlx_model, mlx_dense_logits  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL, model_dir  # noqa: E402
from kakeya_lab.proposers import DraftModelProposer  # noqa: E402
from kakeya_lab.session import SessionStore  # noqa: E402

TINY_TOL = 1e-4
REAL_TOL = 1e-3
CONFIG = dict(sink=4, window=28)


@pytest.fixture(scope="module")
def tiny(tiny_backends):
    """Tiny random models, each on both backends: {arch: (torch_model, mlx_model)}."""
    return {arch: (models["torch"], models["mlx"]) for arch, models in tiny_backends.items()}


@pytest.fixture(scope="module")
def mlx_default():
    return load_mlx_model(model_dir(DEFAULT_MODEL))


def _matrix(name, torch_model, mlx_model, ids, config, tol, record_tolerance):
    want = reference.oracle_logits(torch_model, ids, config)
    if config.positions == "global":
        mlx_want = mlx_dense_logits(mlx_model, ids, config)
    else:  # the dense mask is the rolling oracle only up to the budget
        mlx_want = mlx_dense_logits(mlx_model, ids[: config.budget], config)
    check_close(
        f"{name}/mlx dense vs torch oracle", mlx_want, want[: len(mlx_want)], tol, record_tolerance
    )
    rng = random.Random(0)

    got, v = token_by_token(mlx_model, ids, config)
    check_close(f"{name}/token-by-token vs torch oracle", got, want, tol, record_tolerance)
    check_close(
        f"{name}/token-by-token vs mlx dense", got[: len(mlx_want)], mlx_want, tol, record_tolerance
    )
    assert v.cache_len == config.budget and v.history_len == len(ids)
    assert v.kv_live_bytes == v.kv_budget_bytes() > 0

    got, last, _ = chunked(mlx_model, ids, config, rng)
    check_close(f"{name}/chunked vs torch oracle", got, want, tol, record_tolerance)
    check_close(f"{name}/chunked append vs torch oracle", last, want[-1], tol, record_tolerance)

    got, v = blocks_with_rollback(mlx_model, ids, config, rng)
    assert v.history_token_ids == ids
    check_close(f"{name}/blocks+rollback vs torch oracle", got, want, tol, record_tolerance)


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_mlx_dense_oracle_equals_the_torch_oracle(tiny, arch, mode, record_tolerance):
    """The MLX oracle itself (the incremental paths of every backend are in test_oracle.py)."""
    torch_model, mlx_model = tiny[arch]
    config = SinkWindowConfig(**CONFIG, positions=mode)
    ids = [random.Random(3).randrange(1000, 40000) for _ in range(config.budget)]
    want = reference.oracle_logits(torch_model, ids, config)
    got = mlx_dense_logits(mlx_model, ids, config)
    check_close(
        f"tiny-{arch}/{mode}/mlx dense vs torch oracle", got, want, TINY_TOL, record_tolerance
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_smollm2_mlx_paths_match_oracles(
    default_model, mlx_default, text_ids, mode, record_tolerance
):
    config = SinkWindowConfig(**CONFIG, positions=mode)
    ids = text_ids[: 3 * config.budget]
    _matrix(
        f"smollm2/{mode}", default_model.model, mlx_default, ids, config, REAL_TOL, record_tolerance
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_mlx_random_interleavings_across_many_wraps(tiny, mode, record_tolerance):
    """A few hundred random append / forward_block / commit / rollback operations on the MLX
    backend, every forward checked against the torch single-token reference (kept
    incrementally: committed tokens once, each open block on a fork), and the final history
    against the torch dense oracle in global mode."""
    torch_model, mlx_model = tiny["qwen3"]
    config = SinkWindowConfig(sink=2, window=10, positions=mode)
    rng = random.Random(1234 if mode == "global" else 99)
    v = Verifier(mlx_model, config, prefill_chunk=4)
    # the single-token reference (global mode: equal to the dense forward)
    worst, checks = random_interleavings(v, torch_model, rng, 300)
    assert v.history_len > 5 * config.budget, "the run must wrap the window many times"
    record_tolerance(f"tiny-qwen3/{mode}/mlx random interleavings ({checks} checks)", worst)
    assert worst <= TINY_TOL
    v.rollback()
    if mode == "global":
        dense = reference.dense_logits(torch_model, v.history_token_ids, config)[-1]
        assert (
            v.forward_block([v.history_token_ids[-1]])[0] - dense
        ).abs().max().item() > 0  # a real probe
        v.rollback()
    fresh = Verifier(mlx_model, config)
    fresh.append(v.history_token_ids)
    assert fresh.cached_positions() == v.cached_positions()
    assert fresh.cached_token_ids == v.cached_token_ids


def test_mlx_rollback_after_wrap_keeps_every_committed_entry(tiny):
    import numpy as np

    _, mlx_model = tiny["llama"]
    config = SinkWindowConfig(sink=3, window=8)
    v = Verifier(mlx_model, config)
    rng = random.Random(5)
    v.append([rng.randrange(v.vocab_size) for _ in range(50)])

    def committed_keys():
        pos = v.cache.plan.positions
        slots = np.nonzero(pos >= 0)[0]
        order = slots[np.argsort(pos[slots])]
        return [np.array(layer.keys)[:, :, order] for layer in v.cache.layers]

    before = committed_keys()
    cached = v.cached_token_ids
    probe = [rng.randrange(v.vocab_size) for _ in range(3)]
    want = v.forward_block(probe)
    v.rollback()
    v.forward_block([rng.randrange(v.vocab_size) for _ in range(20)])  # longer than the window
    v.rollback()
    assert v.cached_token_ids == cached
    for now, then in zip(committed_keys(), before):
        assert np.array_equal(now, then)
    assert (v.forward_block(probe) - want).abs().max().item() == 0.0


def test_mlx_kv_live_bytes_grows_then_equals_the_analytic_budget(tiny):
    torch_model, mlx_model = tiny["qwen3"]
    cfg = torch_model.config
    config = SinkWindowConfig(sink=4, window=20)
    budget = config.budget * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 2
    v = Verifier(mlx_model, config)
    series = []
    for i in range(0, 64, 4):
        v.append(list(range(100 + i, 104 + i)))
        series.append(v.kv_live_bytes)
    grow = [b for b, n in zip(series, range(4, 65, 4)) if n < config.budget]
    full = series[len(grow) :]
    assert all(0 < a < b for a, b in zip(grow, grow[1:])) and grow[-1] < budget
    assert full and all(b == budget for b in full), (full, budget)
    assert v.kv_budget_bytes() == budget


@pytest.mark.slow
def test_torch_and_mlx_greedy_streams_over_200_tokens(default_model, mlx_default, text_ids):
    config = SinkWindowConfig(**CONFIG)
    prompt = text_ids[:40]
    streams = {}
    rows = {}
    for name, model in (("torch", default_model.model), ("mlx", mlx_default)):
        v = Verifier(model, config)
        logits = v.append(prompt)
        out, seen = [], []
        for _ in range(200):
            t = int(logits.argmax())
            out.append(t)
            seen.append(logits)
            logits = v.append([t])
        streams[name], rows[name] = out, seen
        assert v.history_len > 5 * config.budget
    print(
        f"torch vs mlx greedy streams over 200 tokens: {'equal' if streams['torch'] == streams['mlx'] else 'differ'}"
    )
    if streams["torch"] != streams["mlx"]:
        i = next(j for j, (a, b) in enumerate(zip(streams["torch"], streams["mlx"])) if a != b)
        top2 = torch.topk(rows["torch"][i], 2)
        margin = (top2.values[0] - top2.values[1]).item()
        print(f"first divergence at token {i}, torch top-2 margin {margin:.3e}")
        assert margin <= 2 * REAL_TOL, (
            f"streams diverge at token {i} (torch {streams['torch'][i]}, mlx {streams['mlx'][i]}) "
            f"with a torch top-2 margin of {margin:.3e}: not a near-tie"
        )


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="llama, qwen2, qwen3"):
        load_mlx_model(tmp_path)


def test_mixing_backends_is_a_clear_error(tiny):
    torch_model, mlx_model = tiny["qwen3"]
    config = SinkWindowConfig(sink=2, window=10)
    store = SessionStore(mlx_model, config, eos_token_ids=[])
    sid = store.create()
    store.append(sid, [5, 6, 7, 8])
    torch_draft = DraftModelProposer(torch_model, config)
    with pytest.raises(ValueError, match="runs on torch but the verifier on mlx"):
        list(store.generate(sid, 4, proposer=torch_draft, draft_length=2))
    assert store.verifier(sid).history_token_ids == [5, 6, 7, 8]
    mlx_draft = DraftModelProposer(mlx_model, config, label="mlx draft")
    torch_store = SessionStore(torch_model, config, eos_token_ids=[])
    tid = torch_store.create()
    torch_store.append(tid, [5, 6, 7, 8])
    with pytest.raises(ValueError, match="runs on mlx but the verifier on torch"):
        list(torch_store.generate(tid, 4, proposer=mlx_draft, draft_length=2))
    with pytest.raises(NotImplementedError, match="torch backend"):
        store.verifier(sid).trace_hidden()
