"""The ``exact`` kernel (kakeya_lab/native/exact.py): a float32 weight that is exactly
``q * d + m`` (4-bit) or ``q * d`` (8-bit) per group of 32 inputs, as a dequantised GGUF's
blocks are, is packed to that form, and its products are the compiled few-row product's bit
for bit; any other weight is not packed and runs ``split``. On the default model (a Q4_1
GGUF with a Q8_0 embedding) every weight packs, and lean steps past eviction, blocks and
rollbacks give ``split``'s logits to the bit, so the oracle tests of ``split`` hold for it
unchanged. Its speed is a benchmark (benchmarks/decode_floor.py), not a test."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from oracle_cases import blocks_with_rollback, token_by_token
from test_linear import torch_threads as threads
from test_tree import _tree_against_oracle as tree_against_oracle

from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.backends.torch_batch import BatchForward, BatchStep
from kakeya_lab.backends.torch_lean import LeanForward
from kakeya_lab.linear import kernel_switched, linear_kernel_of, set_linear_kernel
from kakeya_lab.linear_auto import full_precision_kernels, set_auto_kernel
from kakeya_lab.models import tiny_random_model
from kakeya_lab.native import exact
from kakeya_lab.native.build import compiled, instruction_set
from kakeya_lab.native.rows import MAX_ROWS, rows_product
from kakeya_lab.reference import oracle_logits
from kakeya_lab.tree import DraftTree

pytestmark = pytest.mark.skipif(
    instruction_set() is None, reason="the compiled kernels need AVX-512 or AVX2 with FMA"
)


def q4_weight(out: int, width: int, seed: int = 0) -> torch.Tensor:
    """A weight as a 4-bit GGUF dequantises: per group of 32, ``q * d + m`` in float32 with
    q in 0..15 (0 and 15 both used, as the quantiser's least and greatest value are), d a
    float16 value, m a float32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, width // 32, 32), generator=g).float()
    q[..., 5], q[..., 20] = 0.0, 15.0
    d = (torch.rand(out, width // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = torch.randn(out, width // 32, 1, generator=g) * 0.05
    return (q * d + m).reshape(out, width).contiguous()


def q8_weight(out: int, width: int, seed: int = 0) -> torch.Tensor:
    """A weight as an 8-bit GGUF (Q8_0) dequantises: per group of 32, ``q * d`` with q in
    -127..127 (±127 at the greatest magnitude) and d a float16 value."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out, width // 32, 32), generator=g).float()
    q[..., 7] = 127.0
    d = (torch.rand(out, width // 32, 1, generator=g) * 0.002 + 1e-4).half().float()
    return (q * d).reshape(out, width).contiguous()


@pytest.mark.parametrize("bits", [4, 8])
def test_an_exact_integer_weight_multiplies_to_the_few_row_products_bits(bits):
    assert compiled() is not None
    for out, width in ((7, 64), (33, 96), (96, 64), (130, 576)):
        weight = (q4_weight if bits == 4 else q8_weight)(out, width, seed=out)
        form = exact.pack(weight)
        assert form is not None, (out, width)
        codes, so = form
        assert codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
        assert codes.shape == (out, width * bits // 8)
        assert so.shape == (out, width // 32, 2 if bits == 4 else 1)
        # bytes: 0.75 (4-bit) or 1.125 (8-bit) a weight, against float32's 4
        assert codes.numel() + 4 * so.numel() <= weight.numel() * (bits + 2) // 8
        for n in range(1, MAX_ROWS + 1):
            x = torch.randn(n, width)
            got = exact.exact_product(x, form)
            assert torch.equal(got, rows_product(x, weight)), (out, width, n)
    assert exact.exact_product(torch.randn(MAX_ROWS + 1, 64), form) is None


def test_weights_that_are_not_exactly_4_bit_are_not_packed():
    weight = q4_weight(64, 64)
    assert exact.pack(weight) is not None
    off = weight.clone()
    off[40, 33] = torch.nextafter(off[40, 33], torch.tensor(1.0))  # one weight, one ulp
    assert exact.pack(off) is None
    off8 = q8_weight(64, 64)
    off8[40, 33] = torch.nextafter(off8[40, 33], torch.tensor(1.0))
    assert exact.pack(off8) is None
    assert exact.pack(torch.randn(64, 64)) is None  # a random model's
    assert exact.pack(weight.half()) is None and exact.pack(weight.bfloat16()) is None
    assert exact.pack(weight[:, :48].contiguous()) is None  # width not a multiple of 32
    # a group of one value (q all 0) packs
    flat = weight.clone()
    flat[3, :32] = 0.25
    form = exact.pack(flat)
    assert form is not None and torch.equal(
        exact.exact_product(torch.eye(64)[:16], form), rows_product(torch.eye(64)[:16], flat)
    )


def test_a_packed_form_is_kept_while_its_weight_lives_unchanged():
    weight = q4_weight(64, 64)
    form = exact.packed(weight)
    assert form is not None and exact.packed(weight) is form and exact.is_packed(weight)
    with torch.no_grad():
        weight.mul_(1.0)  # changed in place (same values): packed again
    assert not exact.is_packed(weight)
    assert exact.packed(weight) is not form and exact.is_packed(weight)
    with torch.no_grad():
        weight[0, 0] += 1e-3  # no longer exact: no form
    assert exact.packed(weight) is None and not exact.is_packed(weight)
    with torch.inference_mode():  # no version counter: taken as unchanged
        frozen = q4_weight(64, 64, seed=2)
    assert exact.packed(frozen) is not None and exact.packed(frozen) is exact.packed(frozen)
    other = q4_weight(64, 64, seed=1)
    exact.packed(other)
    key = id(other)  # the table's key (its size also moves as other tests' models are freed)
    assert key in exact._packed
    del other
    gc.collect()
    assert key not in exact._packed  # freed with its weight


def test_an_exact_layer_is_splits_layer_to_the_bit_and_falls_back_where_it_must():
    torch.manual_seed(0)
    for weight in (q4_weight(96, 64), torch.randn(96, 64)):
        layer = torch.nn.Linear(64, 96)
        split = torch.nn.Linear(64, 96)
        with torch.no_grad():
            layer.weight.copy_(weight)
            split.weight.copy_(weight)
            split.bias.copy_(layer.bias)
        assert set_linear_kernel(layer, "exact") == 1 and linear_kernel_of(layer) == "exact"
        set_linear_kernel(split, "split")
        for n in (1, 2, 5, MAX_ROWS, MAX_ROWS + 4):
            x = torch.randn(n, 64)
            with threads(2), torch.no_grad():
                assert torch.equal(layer(x), split(x)), n
        # recording gradients: PyTorch's product, which has a backward
        x = torch.randn(3, 64, requires_grad=True)
        layer(x).sum().backward()
        assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.slow
def test_exact_lean_steps_give_splits_logits_to_the_bit_past_eviction(
    default_model, text_ids, mode
):
    """The default model (a Q4_1 GGUF): every decoder weight, stacked as the lean forward
    runs it, has an exact 4-bit form and the output layer (its tied Q8_0 embedding) an
    8-bit one, the layers run as ``exact`` compiled calls, and one-token steps, then blocks
    with rollbacks, past eviction give exactly ``split``'s logits (which
    tests/test_torch_lean.py holds to the oracle)."""
    model = default_model.model
    lean = LeanForward.of(model)
    config = SinkWindowConfig(sink=4, window=28, positions=mode)
    ids = text_ids[:70]
    with threads(2):
        with kernel_switched(model, "split"):
            want, _ = token_by_token(model, ids, config)
            want_blocks, _ = blocks_with_rollback(model, ids, config, random.Random(3))
        with kernel_switched(model, "exact"):
            before = lean.compiled_layer_calls
            got, v = token_by_token(model, ids, config)
            calls = lean.compiled_layer_calls - before
            got_blocks, _ = blocks_with_rollback(model, ids, config, random.Random(3))
    assert v.history_len == len(ids) > 2 * config.budget and calls > 0
    assert all(
        exact.is_packed(w) for layer in lean.compiled_layers if layer for w in layer.operands
    )
    assert torch.equal(got, want) and torch.equal(got_blocks, want_blocks)
    head = exact.packed(model.get_output_embeddings().weight)
    assert head is not None and head[0].dtype == torch.int8


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.slow
def test_exact_lean_trees_match_the_oracle_past_eviction(
    default_model, text_ids, mode, record_tolerance
):
    """A draft tree on ``exact`` runs the lean forward (in global positions as compiled
    layers) under the tree's ancestor mask, at its nodes' depths: past eviction every
    node's row is the oracle's next-token logits after the history and the node's path,
    and after a non-prefix commit the next block's rows are the oracle's too."""
    model = default_model.model
    lean = LeanForward.of(model)
    config = SinkWindowConfig(sink=4, window=20, positions=mode)
    tree = DraftTree(text_ids[70:76] + [11, 12], [-1, 0, 1, 2, 3, 4, -1, 6])
    with threads(2), kernel_switched(model, "exact"):
        v = Verifier(model, config)
        v.append(text_ids[:70])
        steps, calls = v.backend.lean_steps, lean.compiled_layer_calls
        worst = tree_against_oracle(model, v, tree)
        assert v.backend.lean_steps == steps + 1
        # rolling positions past eviction attend to re-rotated sink copies: no whole-layer call
        assert (lean.compiled_layer_calls > calls) == (mode == "global")
        v.commit_path([6, 7])
        probe = text_ids[80:83]
        got = v.forward_block(probe)
        want = oracle_logits(model, v.history_token_ids + probe, config)[-3:]
    worst = max(worst, (got - want).abs().max().item())
    record_tolerance(f"smollm2 exact lean tree/{mode}", worst)
    assert v.history_token_ids[-2:] == [11, 12] and worst <= 1e-4


def test_a_compiled_layer_reads_a_weight_changed_in_place_from_its_new_exact_form():
    """A compiled layer keeps its weights' exact forms between steps; a weight changed in
    place (here to another exact 4-bit weight, then to one with no exact form) is read
    from what it holds now: the logits stay ``split``'s bit for bit, and a weight with no
    exact form runs the few-row product itself."""
    loaded = tiny_random_model("llama", seed=1, intermediate_size=128)
    model = loaded.model
    with torch.no_grad():
        for i, w in enumerate(p for n, p in model.named_parameters() if "layers." in n):
            if w.dim() == 2:
                w.copy_(q4_weight(*w.shape, seed=10 + i))
    lean = LeanForward.of(model)
    config = SinkWindowConfig(sink=2, window=10, positions="global")
    ids = list(range(100, 120))
    o_proj = model.model.layers[0].self_attn.o_proj.weight

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with threads(2):
            with kernel_switched(model, "split"):
                want, _ = token_by_token(model, ids, config)
            with kernel_switched(model, "exact"):
                got, _ = token_by_token(model, ids, config)
        return got, want

    got, want = both()
    layer = lean.compiled_layers[0]
    assert layer is not None and layer.exact_operands() is not None
    assert torch.equal(got, want)
    with torch.no_grad():
        o_proj.copy_(q4_weight(*o_proj.shape, seed=99))
    got, want2 = both()
    assert torch.equal(got, want2) and not torch.equal(want2, want)
    assert layer.exact_operands() is not None
    with torch.no_grad():
        o_proj.add_(torch.randn(o_proj.shape) * 1e-3)
    got, want3 = both()
    assert layer.exact_operands() is None
    assert torch.equal(got, want3) and not torch.equal(want3, want2)


def test_autos_measurement_keeps_only_the_exact_forms_held_before_it(tmp_path):
    """``auto`` times ``exact`` on each linear layer's own weight, packing it; it drops those
    forms afterwards (the model packs what it runs, e.g. its stacked q/k/v, on use), and
    keeps a form that was held before it."""
    model = tiny_random_model("llama", seed=2, intermediate_size=128).model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for i, layer in enumerate(linears):
            layer.weight.copy_(q4_weight(*layer.weight.shape, seed=30 + i))
    held = linears[0].weight
    assert exact.packed(held) is not None
    with threads(2):
        assert "exact" in full_precision_kernels()
        set_auto_kernel(model, cache_dir=tmp_path)
    assert exact.is_packed(held)
    assert not any(exact.is_packed(layer.weight) for layer in linears[1:])


@pytest.mark.slow
def test_a_batch_of_sessions_on_exact_gives_splits_logits_to_the_bit(default_model, text_ids):
    """Three default-model sessions at different fill levels and position modes, one past
    eviction, stepping together in batched forwards (rows of several caches in one
    compiled layer call where every block is one run of slots): on ``exact`` every row's
    logits are ``split``'s bit for bit."""
    model = default_model.model
    configs = [
        SinkWindowConfig(sink=4, window=28, positions="global"),
        SinkWindowConfig(sink=4, window=28, positions="rolling"),
        SinkWindowConfig(sink=3, window=30, positions="global"),
    ]
    starts = [(0, 40), (50, 12), (80, 20)]

    def run(kernel: str) -> list[torch.Tensor]:
        with threads(2), kernel_switched(model, kernel):
            verifiers = [Verifier(model, c) for c in configs]
            for v, (o, n) in zip(verifiers, starts):
                v.append(list(text_ids[o : o + n]))
            forward = BatchForward.of(model)
            rows = []
            for r in range(12):
                steps = [
                    BatchStep(v.cache, [text_ids[200 + r + 3 * j]], all_rows=False)
                    for j, v in enumerate(verifiers)
                ]
                for v, logits in zip(verifiers, forward(steps)):
                    v.cache.commit(1)
                    rows.append(logits[-1])
            assert verifiers[0].cache.history_len > configs[0].budget
            return rows

    lean = LeanForward.of(model)
    want = run("split")
    before = lean.compiled_layer_calls
    got = run("exact")
    assert lean.compiled_layer_calls > before
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_stores_warm_up_packs_what_its_steps_read_and_leaves_nothing_open():
    """``SessionStore.warm_up`` (run by ``serve`` before its ready line and by ``chat``): one
    throwaway step packs every exact form the lean step reads (the stacked projections), so
    the first session's steps pack nothing; no session is opened and no K/V is kept, and
    that session, past eviction, decodes ``split``'s greedy tokens (exact's bits are
    split's)."""
    from kakeya_lab.session import SessionStore, Token

    model = tiny_random_model("llama", seed=3, intermediate_size=128).model
    with torch.no_grad():
        for i, layer in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            layer.weight.copy_(q4_weight(*layer.weight.shape, seed=50 + i))
    config = SinkWindowConfig(sink=2, window=14)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(30)]  # past sink + window

    def greedy(store: SessionStore) -> list[int]:
        sid = store.create()
        store.append(sid, prompt)
        tokens = [e.id for e in store.generate(sid, 12) if isinstance(e, Token)]
        assert store.verifier(sid).history_len > config.budget  # evicted
        store.close(sid)
        return tokens

    with threads(2):
        set_linear_kernel(model, "split")
        want = greedy(SessionStore(model, config, capacity=1, eos_token_ids=[]))
    set_linear_kernel(model, "exact")
    lean = LeanForward.of(model)
    store = SessionStore(model, config, capacity=1, eos_token_ids=[])
    operands = [w for layer in lean.compiled_layers if layer for w in layer.operands]
    assert operands and not any(exact.is_packed(w) for w in operands)
    with threads(2):
        store.warm_up()
        assert all(exact.is_packed(w) for w in operands)
        assert len(store) == 0 and store.kv_live_bytes() == 0
        packed = len(exact._packed)
        got = greedy(store)
    assert len(exact._packed) == packed  # the first session's steps packed nothing new
    assert got == want and len(got) == 12
