"""The compiled int4 product on integer dot products (kakeya_lab/native/int4.cpp, the
``int4-vnni`` linear kernel): it computes exactly its contract (each row written per group of
32 inputs as two int8 parts, the group's exact sum kept for the offsets) for one to many rows;
it is the float product with the dequantised weights to within those parts' rounding, far
closer than ``int4``'s bfloat16 rows; an ``int4-vnni`` layer runs it for every row count and
is reversible; bad operands get a clear error; and a draft model on it keeps speculative
decoding equal to plain decoding past eviction, with most drafts accepted. Its speed is
measured by notebook 35 (``draft:MODEL:int4-vnni``), not here."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from oracle_cases import blocks_with_rollback, check_close

from kakeya_lab import SinkWindowConfig, load_model
from kakeya_lab.backends.torch_lean import LeanForward
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.data import domain_conversations
from kakeya_lab.linear import (
    INT4_GROUP,
    Int4VnniLinear,
    check_linear_kernel,
    linear_kernel_of,
    quantize_int4,
    set_linear_kernel,
)
from kakeya_lab.models import DEFAULT_MODEL
from kakeya_lab.native.int4 import CPU_FLAGS, int4_product, pack, why_unavailable
from kakeya_lab.proposers import make_proposer
from kakeya_lab.reference import oracle_logits
from kakeya_lab.results import cpu_identity

# the CPU's flags decide at collection (cheap); a build that fails then fails the tests
pytestmark = pytest.mark.skipif(
    not set(CPU_FLAGS) <= set(cpu_identity()["cpu_flags"]),
    reason=f"the int4-vnni kernel needs {', '.join(CPU_FLAGS)}",
)


def _dequantised(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    steps = scale.float().repeat_interleave(INT4_GROUP, dim=1)
    return (q.float() - 8) * steps + offset.float().repeat_interleave(INT4_GROUP, dim=1)


def _rows_rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's integer rows: ``(xq + xr / 254, sx)`` per input, ``x ~ sx * (xq + xr /
    254)`` (float32 arithmetic as the kernel does it, ties to even)."""
    groups = x.view(x.shape[0], -1, INT4_GROUP)
    top = groups.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    scaled = groups * inv
    xq = torch.round(scaled)
    xr = torch.round((scaled - xq) * 254.0)
    assert xq.abs().max() <= 127 and xr.abs().max() <= 127  # each part one int8
    parts = xq.double() + xr.double() / 254.0
    sx = (top / 127.0).expand_as(groups)
    return parts.reshape(x.shape), sx.reshape(x.shape)


@pytest.mark.parametrize("n", [1, 3, 16, 40])
@pytest.mark.parametrize("shape", [(64, 32), (192, 96), (960, 576), (576, 1536)])
def test_the_product_is_its_contract_exactly_and_the_float_product_within_rounding(n, shape):
    torch.manual_seed(n * 7 + shape[0])
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features) * 0.05
    q, scale, offset = quantize_int4(weight)
    x = torch.randn(n, in_features) * 2
    x[0, :INT4_GROUP] = 0.0  # a group of zeros: scale 0, no division by it
    if n > 1:
        x[1, 5] = 40.0  # an outlier: its group's rows round coarsely
    got = int4_product(x, *pack(q, scale, offset))
    assert got.shape == (n, out_features) and got.dtype == torch.float32

    # w = q * s + (o - 8 s): the rows as integers times q * s, the rows themselves times the rest
    stepped = q.double() * scale.double().repeat_interleave(INT4_GROUP, dim=1)
    rest = _dequantised(q, scale, offset).double() - stepped
    parts, sx = _rows_rounded(x)
    rounded = parts * sx.double()
    exact = rounded @ stepped.T + x.double() @ rest.T  # the contract, in float64
    magnitude = rounded.abs() @ stepped.abs().T + x.double().abs() @ rest.abs().T
    assert ((got.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all()
    # the float product: off by at most half a step of the second part, per input
    want = x.double() @ (stepped + rest).T
    bound = (sx.double() / 508) @ stepped.abs().T
    assert ((got.double() - want).abs() <= bound * 1.001 + 1e-5 * magnitude + 1e-6).all()
    # rows without outliers: far closer than int4's bfloat16 rows (PyTorch's kernel)
    typical = torch.randn(4, in_features)
    exact_typical = typical.double() @ (stepped + rest).T
    ours = (int4_product(typical, *pack(q, scale, offset)).double() - exact_typical).abs().max()
    bf16 = (typical.bfloat16().double() @ (stepped + rest).T - exact_typical).abs().max()
    assert ours < bf16 / 10


def test_an_int4_vnni_layer_runs_the_kernel_for_any_row_count_and_is_reversible():
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 128)
    ref = copy.deepcopy(layer)
    assert why_unavailable() == ""  # on a CPU with the flags, a failed build says why here
    check_linear_kernel("int4-vnni")
    assert set_linear_kernel(layer, "int4-vnni") == 1 and isinstance(layer, Int4VnniLinear)
    assert linear_kernel_of(layer) == "int4-vnni"
    deq = _dequantised(*quantize_int4(ref.weight))
    for rows in (torch.randn(2, 96), torch.randn(3, 50, 96)):  # a step, a prefill
        with torch.no_grad():
            got = layer(rows)
        flat = rows.reshape(-1, 96)
        want = (int4_product(flat, *pack(*quantize_int4(ref.weight))) + ref.bias).view_as(got)
        assert torch.equal(got, want)  # the int4 copy for every row count, not the weights
        assert (got - (rows @ deq.T + ref.bias)).abs().max() <= 1e-4 * got.abs().max()
    assert set(layer.state_dict()) == {"weight", "bias"}
    assert set_linear_kernel(layer, "aten") == 1 and "_packed" not in layer.__dict__
    x = torch.randn(4, 96)
    with torch.no_grad():
        assert torch.equal(layer(x), ref(x))
    odd = torch.nn.Linear(96, 40)  # 40 outputs: not tiles of 64, so it keeps aten
    assert set_linear_kernel(odd, "int4-vnni") == 0 and type(odd) is torch.nn.Linear


def test_bad_operands_get_a_clear_error():
    weight = torch.randn(64, 64)
    packed, scales = pack(*quantize_int4(weight))
    with pytest.raises(RuntimeError, match="rows of 64 inputs, got 32"):
        int4_product(torch.randn(1, 32), packed, scales)
    with pytest.raises(RuntimeError, match="float32"):
        int4_product(torch.randn(1, 64, dtype=torch.float64), packed, scales)
    with pytest.raises(RuntimeError, match="scales"):
        int4_product(torch.randn(1, 64), packed, scales[:, :, :2])
    with pytest.raises(ValueError, match="out % 64"):
        pack(*quantize_int4(torch.randn(48, 64)))


def test_an_int4_vnni_draft_keeps_speculative_decoding_lossless_past_eviction(default_model):
    """The default model's own int4 copy on this kernel drafts through the lean forward: the
    stream is plain decoding's over two turns of held-out chit-chat that outgrow a 4 + 60
    cache, and most drafts are accepted."""
    config = SinkWindowConfig(sink=4, window=60)
    draft = load_model(DEFAULT_MODEL, dtype=torch.float32, linear="int4-vnni", progress=False)
    assert draft.description.linear == "int4-vnni"
    made = []

    def proposer():
        made.append(
            make_proposer(f"draft:{DEFAULT_MODEL}", default_model.model, config, draft_model=draft)
        )
        return made[-1]

    run = run_speculative(
        default_model,
        {"int4-vnni": proposer},
        domain_conversations("chitchat", "dev")[:1],
        SpeculativeSettings.for_cache(
            config, draft_lengths=(4,), turns=2, max_new_tokens=40, measure_cost=False
        ),
        progress=False,
    )
    assert greedy_streams_identical(run.turns)
    assert run.turns["history_len"].max() > config.budget
    assert made and made[0].describe()["forward"] == "lean"
    drafted = run.turns[run.turns["arm"] != "plain"]
    assert drafted["accepted"].sum() >= 0.6 * drafted["proposed"].sum()


@pytest.fixture(scope="module")
def int4_vnni_model():
    """The default model with its linear layers on ``int4-vnni`` (its own module-scoped copy:
    a test switches its lean forward's compiled layers off)."""
    return load_model(DEFAULT_MODEL, dtype=torch.float32, linear="int4-vnni", progress=False)


@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_an_int4_vnni_lean_forward_runs_whole_layers_compiled_and_matches_the_oracle(
    int4_vnni_model, text_ids, mode, record_tolerance
):
    """Blocks with rollbacks past eviction: the logits are the dense oracle's of the same
    model (its layers on the same kernel), every forward after the first (which finds no
    storage yet) runs each of its layers as one compiled call wherever the block is
    one run of slots (always in global positions; rolling positions with sink copies fall
    back to the operations one by one), and those operations one by one give the same logits
    bit for bit. The tolerance is a quantised model's: rounding the rows to integers turns
    the float32 jitter between any two orders of the same sums into whole rounding steps,
    so transformers' forward through the same cache is as far from the oracle (about 2e-2
    here); PyTorch's int4 kernel, with bfloat16 rows, is up to 4 away."""
    model = int4_vnni_model.model
    lean = LeanForward.of(model)
    layers = len(lean.layers)
    assert all(c is not None and c.kind == "int4" for c in lean.compiled_layers)
    config = SinkWindowConfig(sink=4, window=28, positions=mode)
    ids = text_ids[:100]
    forwards, calls = lean.forwards, lean.compiled_layer_calls
    got, v = blocks_with_rollback(model, ids, config, random.Random(5), lean=True)
    assert v.history_len == len(ids) > 3 * config.budget
    fused, most = lean.compiled_layer_calls - calls, layers * (lean.forwards - forwards - 1)
    assert fused == most if mode == "global" else 0 < fused < most
    want = oracle_logits(model, ids, config)
    check_close(f"smollm2 int4-vnni lean/{mode}/blocks+rollback", got, want, 5e-2, record_tolerance)
    operands, lean.compiled_layers = lean.compiled_layers, [None] * layers
    try:
        one_by_one, _ = blocks_with_rollback(model, ids, config, random.Random(5), lean=True)
    finally:
        lean.compiled_layers = operands
    assert torch.equal(got, one_by_one)
