"""The linear layers' kernel (``kakeya_lab.linear``): oneDNN's linear in place of PyTorch's
default must leave the weights alone, be reversible, give the oracle's logits through the
sink-window verifier across eviction, blocks and rollback, and keep greedy speculative
decoding equal to plain decoding. The int8 and int4 kernels (for draft models) must be the
bfloat16 product with the dequantised weight (the exact weights for a prefill), reversible,
and keep a draft model's speculative decoding equal to plain decoding with most drafts
accepted. The speed is measured by ``benchmarks/verify_cost.py``,
``benchmarks/draft_model_cost.py`` and notebook 35 (``linear``, ``draft_linear``), not here."""

from __future__ import annotations

import copy
import random
from contextlib import contextmanager

import pytest
import torch
from oracle_cases import blocks_with_rollback, check_close, chunked

from kakeya_lab import SinkWindowConfig, load_model
from kakeya_lab.backends.torch_lean import LeanForward
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.data import domain_conversations
from kakeya_lab.linear import (
    INT4_GROUP,
    QUANTISED_ROWS,
    Int4Linear,
    Int8Linear,
    OneDNNLinear,
    SplitLinear,
    kernel_switched,
    linear_as,
    linear_kernel_of,
    quantize_int4,
    quantize_int8,
    set_linear_kernel,
    stack_rows,
)
from kakeya_lab.models import DEFAULT_MODEL
from kakeya_lab.native.build import compiled, instruction_set, why_unavailable
from kakeya_lab.native.rows import MAX_ROWS, rows_product
from kakeya_lab.proposers import NgramProposer, make_proposer
from kakeya_lab.reference import oracle_logits

# Another kernel for the same float32 products: rounding of the same size as a block against a
# one-token forward, but not the bit pattern tests/test_oracle.py's 1e-4 was set from (one
# thread per worker gave 1.05e-4 on the global chunked path; the MLX oracle tests allow 1e-3).
TOL = 2e-4


EVICTING = SinkWindowConfig(sink=4, window=60)  # two turns of code outgrow it


def _code_run_past_eviction(loaded, proposers, draft_lengths):
    """Plain decoding and the arms on two turns of held-out code through :data:`EVICTING`,
    which the history outgrows (checked)."""
    config = EVICTING
    run = run_speculative(
        loaded,
        proposers,
        domain_conversations("code", "dev", limit=1),
        SpeculativeSettings.for_cache(
            config,
            draft_lengths=tuple(draft_lengths),
            turns=2,
            max_new_tokens=24,
            measure_cost=False,
        ),
        progress=False,
    )
    assert run.turns["history_len"].max() > config.budget
    return run


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
@pytest.mark.slow
def test_onednn_verifier_gives_the_oracle_logits_past_eviction(
    onednn_model, aten_model, text_ids, mode, record_tolerance
):
    """Blocks with wrong tails, partial commits and rollbacks, and chunked appends, over a
    history that wraps a small window many times; the oracle runs the same model (the same
    kernel), and agrees with the default kernel's oracle to float32 rounding."""
    assert onednn_model.description.linear == "onednn"
    assert aten_model.description.linear == "aten"
    assert onednn_model.description.weight_sha256 == aten_model.description.weight_sha256
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
    aten = oracle_logits(aten_model.model, ids, config)
    check_close(f"smollm2/{mode}/onednn oracle vs aten oracle", want, aten, TOL, record_tolerance)


@contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch threads (the ``split`` kernel splits over them; the
    tests' workers run one), restoring the count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_split_is_the_linear_product_with_one_slice_of_outputs_per_thread():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96)
    odd = torch.nn.Linear(64, 7, bias=False)  # no thread count above 1 divides 7
    inputs = {rows: torch.randn(rows, 64) for rows in (1, 3, 8, 40)}
    with torch.no_grad():
        want = {rows: layer(x) for rows, x in inputs.items()}
    weight = layer.weight.data_ptr()
    for module in (layer, odd):
        set_linear_kernel(module, "split")
        assert isinstance(module, SplitLinear)
    for threads in (1, 2, 3, 4):
        with torch_threads(threads), torch.no_grad():
            for rows, x in inputs.items():
                got = layer(x)
                assert got.shape == want[rows].shape
                assert (got - want[rows]).abs().max().item() <= 1e-5, (threads, rows)
                assert layer(x[None]).shape == (1, rows, 96)  # leading dimensions kept
            assert torch.equal(odd(inputs[3]), torch.nn.functional.linear(inputs[3], odd.weight))
    assert layer.weight.data_ptr() == weight  # the slices are views: nothing was copied


def test_the_compiled_few_row_product_is_the_linear_product():
    """On a CPU with AVX-512, or AVX2 and FMA (this machine kind), the few-row product
    builds, and for 1 to 16 rows it is ``rows @ weight.T`` to float32 rounding, for output
    widths that its blocks of weight rows do not divide; a row's output is the same to the
    bit whatever rows come with it (a session batched with others computes what it computes
    alone); ``split`` runs it for 1 to 16 rows (and its PyTorch products for more rows or
    other widths), to the same numbers."""
    if instruction_set() is None:
        pytest.skip("the compiled product needs AVX-512 or AVX2 with FMA")
    assert compiled() is not None, why_unavailable()
    torch.manual_seed(0)
    for out_features in (1, 7, 33, 96):
        weight = torch.randn(out_features, 64)
        for n in range(1, MAX_ROWS + 1):
            x = torch.randn(n, 64)
            got = rows_product(x, weight)
            assert got is not None and got.shape == (n, out_features)
            assert (got - x @ weight.t()).abs().max().item() <= 1e-5, (out_features, n)
            for i in range(n):
                assert torch.equal(got[i : i + 1], rows_product(x[i : i + 1], weight)), (n, i)
    assert rows_product(torch.randn(2, 40), torch.randn(8, 40)) is None  # width: not 16k
    assert rows_product(torch.randn(MAX_ROWS + 1, 64), torch.randn(8, 64)) is None
    layer = torch.nn.Linear(64, 96)
    set_linear_kernel(layer, "split")
    for n in (1, 2, 5, MAX_ROWS, MAX_ROWS + 4):
        x = torch.randn(n, 64)
        with torch_threads(2), torch.no_grad():
            got = layer(x)
            assert (
                got - torch.nn.functional.linear(x, layer.weight, layer.bias)
            ).abs().max() <= 1e-5
            if n <= MAX_ROWS:  # the compiled product ran, one row included
                assert torch.equal(got, rows_product(x, layer.weight) + layer.bias), n


def test_stacked_layers_are_views_of_one_tensor_and_multiply_as_their_outputs_side_by_side():
    """``stack_rows`` re-lays the layers' weights (and biases) once as one tensor's rows:
    values unchanged, each parameter a view of it (a second call copies nothing, a change to
    one is a change to the other), the model still trains; ``linear_as`` multiplies by it on
    the layers' kernel and gives their outputs side by side."""
    torch.manual_seed(0)
    make = [(64, 32, True), (64, 16, True), (64, 48, True)]
    layers = [torch.nn.Linear(i, o, bias=b) for i, o, b in make]
    before = [(layer.weight.detach().clone(), layer.bias.detach().clone()) for layer in layers]
    x = torch.randn(3, 64)
    with torch.no_grad():
        want = torch.cat([layer(x) for layer in layers], dim=-1)
    with torch.inference_mode():  # as the lean forward builds it
        weight, bias = stack_rows(layers)
    assert weight.shape == (96, 64) and bias is not None and bias.shape == (96,)
    start = 0
    for layer, (w, b) in zip(layers, before, strict=True):
        assert torch.equal(layer.weight, w) and torch.equal(layer.bias, b)
        assert layer.weight.data_ptr() == weight[start].data_ptr()
        assert layer.bias.data_ptr() == bias[start:].data_ptr()
        start += layer.out_features
    again = stack_rows(layers)
    assert again[0].data_ptr() == weight.data_ptr() and again[1].data_ptr() == bias.data_ptr()
    for kernel, threads in (("aten", 1), ("onednn", 1), ("split", 2)):
        for layer in layers:
            set_linear_kernel(layer, kernel)
        with torch_threads(threads), torch.no_grad():
            got = linear_as(layers[0], weight, bias, x)
        assert (got - want).abs().max().item() <= 1e-5, kernel
    with torch.no_grad():
        layers[1].weight.add_(1.0)
    assert torch.equal(weight[32:48], layers[1].weight)
    sum(layer(x).sum() for layer in layers).backward()  # still a trainable model
    assert all(layer.weight.grad is not None for layer in layers)
    mixed = [torch.nn.Linear(64, 8, bias=True), torch.nn.Linear(64, 8, bias=False)]
    _, mixed_bias = stack_rows(mixed)  # a missing bias stacks as zeros
    assert mixed_bias is not None and torch.equal(mixed_bias[8:], torch.zeros(8))


# slow in both modes (38 s in the fast loop on two oversubscribed threads): the product test
# above keeps split in the fast loop
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_split_verifier_gives_the_oracle_logits_past_eviction(
    aten_model, text_ids, mode, record_tolerance
):
    """As the oneDNN test above, on the default model's own layers switched to ``split``
    (two threads, so it does split, its lean steps' layers each one compiled call) and
    back."""
    model = aten_model.model
    config = SinkWindowConfig(sink=4, window=28, positions=mode)
    ids = text_ids[:150]
    aten = oracle_logits(model, ids, config)
    with torch_threads(2), kernel_switched(model, "split"):
        assert linear_kernel_of(model) == "split"
        want = oracle_logits(model, ids, config)
        lean = LeanForward.of(model)
        layers_before = lean.compiled_layer_calls
        got, v = blocks_with_rollback(model, ids, config, random.Random(3))
        if lean.native is not None:  # its layers ran as one compiled call each
            assert lean.compiled_layer_calls > layers_before
        assert v.history_len == len(ids) > 4 * config.budget
        rows, last, _ = chunked(model, ids, config, random.Random(4))
    assert linear_kernel_of(model) == "aten"
    check_close(f"smollm2 split/{mode}/blocks+rollback", got, want, TOL, record_tolerance)
    check_close(f"smollm2 split/{mode}/chunked", rows, want, TOL, record_tolerance)
    check_close(f"smollm2 split/{mode}/chunked append", last, want[-1], TOL, record_tolerance)
    check_close(f"smollm2/{mode}/split oracle vs aten oracle", want, aten, TOL, record_tolerance)


@pytest.mark.slow
def test_onednn_greedy_speculative_decoding_equals_plain_past_eviction(onednn_model):
    """Plain decoding and the speculative arms share the loaded model, so both run oneDNN's
    kernel; the arms must emit exactly the plain stream."""
    run = _code_run_past_eviction(onednn_model, {"ngram": NgramProposer}, [3, 6])
    assert greedy_streams_identical(run.turns)


@pytest.mark.slow
def test_a_draft_model_loaded_by_name_runs_the_verifiers_kernel(onednn_model):
    config = SinkWindowConfig(sink=4, window=60)
    proposer = make_proposer(
        f"draft:{DEFAULT_MODEL}", onednn_model.model, config, onednn_model.tokenizer
    )
    assert linear_kernel_of(proposer.model) == "onednn"


def test_an_int8_layer_is_the_bfloat16_product_with_its_dequantised_weight():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40)
    ref = copy.deepcopy(layer)
    assert set_linear_kernel(layer, "int8") == 1 and isinstance(layer, Int8Linear)
    assert linear_kernel_of(layer) == "int8"
    q, scale = quantize_int8(ref.weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16
    deq = q.float() * scale.float()[:, None]
    # each weight within half an int8 step of its value (the scale is rounded before q is)
    assert ((deq - ref.weight).abs() <= scale.float()[:, None] * 0.5 + 1e-8).all()
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        got = layer(x)
        want = x.bfloat16().float() @ deq.T + ref.bias
    assert got.shape == (2, 3, 40) and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()  # bf16 output
    assert set_linear_kernel(layer, "aten") == 1 and "_packed" not in layer.__dict__
    with torch.no_grad():
        assert torch.equal(layer(x), ref(x))
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_an_int4_layer_is_the_bfloat16_product_with_its_dequantised_weight():
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 48)
    ref = copy.deepcopy(layer)
    assert set_linear_kernel(layer, "int4") == 1 and isinstance(layer, Int4Linear)
    assert linear_kernel_of(layer) == "int4"
    q, scale, offset = quantize_int4(ref.weight)
    assert q.shape == (48, 96) and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scale.shape == offset.shape == (48, 96 // INT4_GROUP)
    step = scale.float().repeat_interleave(INT4_GROUP, dim=1)
    deq = (q.float() - 8) * step + offset.float().repeat_interleave(INT4_GROUP, dim=1)
    # each weight within half an int4 step of its value, plus the offset's bf16 rounding
    tol = step * 0.5 + offset.float().abs().repeat_interleave(INT4_GROUP, dim=1) / 256
    assert ((deq - ref.weight).abs() <= tol + 1e-8).all()
    x = torch.randn(5, 96)
    with torch.no_grad():
        got = layer(x)
        want = x.bfloat16().float() @ deq.T + ref.bias
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    # a prefill: the layer's own weights, not the int4 copy
    many = torch.randn(2, QUANTISED_ROWS, 96)
    with torch.no_grad():
        assert (layer(many) - ref(many)).abs().max().item() <= 1e-5
    assert set_linear_kernel(layer, "aten") == 1
    with torch.no_grad():
        assert torch.equal(layer(x), ref(x))


def test_int8_leaves_layers_the_kernel_cannot_tile_and_is_reversible_on_a_model(tiny_model):
    model = copy.deepcopy(tiny_model.model)
    odd = torch.nn.Linear(24, 8)  # an input width the int8 kernel cannot tile (16)
    model.add_module("odd", odd)
    ids = torch.tensor([[5, 17, 301, 9, 42, 7, 7, 1000]])
    keys = set(model.state_dict())
    with torch.no_grad():
        want = model(ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert set_linear_kernel(model, "int8") == linears - 1
    assert type(odd) is torch.nn.Linear and set(model.state_dict()) == keys
    with torch.no_grad():
        got = model(ids).logits
    assert 0 < (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    assert set_linear_kernel(model, "int4") > 0 and linear_kernel_of(model) == "int4"
    assert type(odd) is torch.nn.Linear
    assert set_linear_kernel(model, "onednn") == linears  # from int4 straight to another
    assert set_linear_kernel(model, "aten") == linears
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


@pytest.mark.slow
def test_an_int8_draft_model_keeps_speculative_decoding_lossless_past_eviction(default_model):
    """The int8 copy changes the draft's numbers, not the verifier's: the stream equals plain
    decoding, and a draft that is the verifier up to int8 rounding has most drafts accepted,
    here with its own cache shorter than the verifier's (``draft_window``)."""
    config = EVICTING
    draft = load_model(DEFAULT_MODEL, dtype=torch.float32, linear="int8", progress=False)
    assert draft.description.linear == "int8"

    def proposer():
        return make_proposer(
            f"draft:{DEFAULT_MODEL}",
            default_model.model,
            config,
            default_model.tokenizer,
            draft_model=draft,
            draft_window=40,
        )

    run = _code_run_past_eviction(default_model, {"draft": proposer}, [4])
    assert greedy_streams_identical(run.turns)
    drafted = run.turns[run.turns["arm"] != "plain"]
    assert drafted["accepted"].sum() >= 0.75 * drafted["proposed"].sum()
    by_name = make_proposer(  # the spec's kernel wins over draft_linear, the default
        f"draft:{DEFAULT_MODEL}:int4",
        default_model.model,
        config,
        default_model.tokenizer,
        draft_linear="int8",
        draft_window=40,
    )
    assert linear_kernel_of(by_name.model) == "int4" and by_name.label.endswith(":int4")
    assert by_name.config == SinkWindowConfig(sink=4, window=40)
    by_name.propose(list(range(100, 200)), 2)
    assert by_name.verifier.cache_len <= 4 + 40
    with pytest.raises(ValueError, match="already loaded"):  # draft_model has its own kernel
        make_proposer(f"draft:{DEFAULT_MODEL}:int4", default_model.model, config, draft_model=draft)
