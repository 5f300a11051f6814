"""The linear layers' kernel (``kakeya_lab.linear``): oneDNN's linear in place of PyTorch's
default must leave the weights alone, be reversible, give the oracle's logits through the
sink-window verifier across eviction, blocks and rollback, and keep greedy speculative
decoding equal to plain decoding. The speed is measured by ``benchmarks/verify_cost.py``
and notebook 35 (``linear``), not here."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from oracle_cases import blocks_with_rollback, check_close, chunked

from kakeya_lab import SinkWindowConfig, load_model
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.data import domain_conversations
from kakeya_lab.linear import OneDNNLinear, linear_kernel_of, set_linear_kernel
from kakeya_lab.models import DEFAULT_MODEL
from kakeya_lab.proposers import NgramProposer, make_proposer
from kakeya_lab.reference import oracle_logits

# Another kernel for the same float32 products: rounding of the same size as a block against a
# one-token forward, but not the bit pattern tests/test_oracle.py's 1e-4 was set from (one
# thread per worker gave 1.05e-4 on the global chunked path; the MLX oracle tests allow 1e-3).
TOL = 2e-4


@pytest.fixture(scope="module")
def onednn_model():
    """The default real model, loaded with its linear layers on oneDNN's kernel."""
    return load_model(DEFAULT_MODEL, dtype=torch.float32, linear="onednn", progress=False)


def test_switching_kernels_keeps_the_weights_and_is_reversible(tiny_model):
    model = copy.deepcopy(tiny_model.model)
    ids = torch.tensor([[5, 17, 301, 9, 42, 7, 7, 1000]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert linears > 0 and linear_kernel_of(model) == "aten"
    assert set_linear_kernel(model, "onednn") == linears
    assert linear_kernel_of(model) == "onednn"
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    with torch.no_grad():
        got = model(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="unknown linear kernel"):
        set_linear_kernel(model, "fast")
    assert linear_kernel_of(model) == "onednn"  # a refused switch changed nothing
    assert set_linear_kernel(model, "aten") == linears
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # bit for bit the default path again
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_gradients_flow_through_a_switched_layer():
    """Training (a drafter, LoRA) records gradients: the layer falls back to PyTorch's
    kernel, whose backward gives the same gradients as an unswitched layer."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(16, 8)
    switched = copy.deepcopy(plain)
    set_linear_kernel(switched, "onednn")
    assert isinstance(switched, OneDNNLinear)
    x = torch.randn(3, 16)
    plain(x).square().sum().backward()
    switched(x).square().sum().backward()
    assert plain.weight.grad is not None and switched.weight.grad is not None
    assert torch.equal(plain.weight.grad, switched.weight.grad)


def test_loading_with_an_unknown_kernel_fails_before_loading():
    with pytest.raises(ValueError, match="unknown linear kernel"):
        load_model(DEFAULT_MODEL, linear="fast", progress=False)
    with pytest.raises(ValueError, match="torch kernel"):
        load_model(DEFAULT_MODEL, backend="mlx", linear="onednn", progress=False)


@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_onednn_verifier_gives_the_oracle_logits_past_eviction(
    onednn_model, default_model, text_ids, mode, record_tolerance
):
    """Blocks with wrong tails, partial commits and rollbacks, and chunked appends, over a
    history that wraps a small window many times; the oracle runs the same model (the same
    kernel), and agrees with the default kernel's oracle to float32 rounding."""
    assert onednn_model.description.linear == "onednn"
    assert default_model.description.linear == "aten"
    assert onednn_model.description.weight_sha256 == default_model.description.weight_sha256
    model = onednn_model.model
    config = SinkWindowConfig(sink=4, window=28, positions=mode)
    ids = text_ids[:150]
    want = oracle_logits(model, ids, config)
    got, v = blocks_with_rollback(model, ids, config, random.Random(3))
    assert v.history_len == len(ids) > 4 * config.budget
    check_close(f"smollm2 onednn/{mode}/blocks+rollback", got, want, TOL, record_tolerance)
    rows, last, _ = chunked(model, ids, config, random.Random(4))
    check_close(f"smollm2 onednn/{mode}/chunked", rows, want, TOL, record_tolerance)
    check_close(f"smollm2 onednn/{mode}/chunked append", last, want[-1], TOL, record_tolerance)
    aten = oracle_logits(default_model.model, ids, config)
    check_close(f"smollm2/{mode}/onednn oracle vs aten oracle", want, aten, TOL, record_tolerance)


def test_onednn_greedy_speculative_decoding_equals_plain_past_eviction(onednn_model):
    """Plain decoding and the speculative arms share the loaded model, so both run oneDNN's
    kernel; the arms must emit exactly the plain stream."""
    config = SinkWindowConfig(sink=4, window=60)
    run = run_speculative(
        onednn_model,
        {"ngram": NgramProposer},
        [3, 6],
        domain_conversations("code", "dev", limit=1),
        config=config,
        turns_per_conversation=2,
        max_new_tokens=24,
        measure_cost=False,
        progress=False,
    )
    assert greedy_streams_identical(run.turns)
    assert run.turns["history_len"].max() > config.budget


def test_a_draft_model_loaded_by_name_runs_the_verifiers_kernel(onednn_model):
    config = SinkWindowConfig(sink=4, window=60)
    proposer = make_proposer(
        f"draft:{DEFAULT_MODEL}", onednn_model.model, config, onednn_model.tokenizer
    )
    assert linear_kernel_of(proposer.model) == "onednn"
