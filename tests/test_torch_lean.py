"""The lean forward (kakeya_lab/backends/torch_lean.py) against the dense masked oracle, as
tightly as transformers' forward (1e-4 on float32): one-token steps, blocks with wrong tails,
partial commits and rollbacks, and chunked appends that mix lean blocks (up to 16 tokens)
with transformers' forward (longer ones), over histories that wrap a small window many
times, in global and rolling positions; which verifiers run it by default; then what a
draft model does with it. Its speed is a benchmark (benchmarks/decode_floor.py,
benchmarks/draft_model_cost.py), not a test."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from oracle_cases import blocks_with_rollback, check_close, chunked, token_by_token
from transformers import AutoModelForCausalLM

from kakeya_lab import SinkWindowConfig, load_model
from kakeya_lab.backends.torch_lean import MAX_TOKENS, ROPE_BLOCK, ROPE_BLOCKS_KEPT, LeanForward
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.data import domain_conversations
from kakeya_lab.linear import kernel_switched, set_linear_kernel
from kakeya_lab.models import DEFAULT_MODEL, tiny_random_model
from kakeya_lab.native.build import instruction_set
from kakeya_lab.proposers import DraftModelProposer
from kakeya_lab.reference import oracle_logits

TOL = 1e-4  # what tests/test_oracle.py holds transformers' forward to


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_lean_forward_gives_the_oracle_logits_past_eviction(architecture, mode, record_tolerance):
    loaded = tiny_random_model(architecture, seed=1)
    model = loaded.model
    lean = LeanForward.of(model)  # what a verifier with lean=True runs
    # the compiled step operations run wherever they build (native/step.py)
    assert (lean.native is not None) == (instruction_set() is not None)
    config = SinkWindowConfig(sink=3, window=17, positions=mode)
    ids = [random.Random(2).randrange(loaded.model.config.vocab_size) for _ in range(120)]
    want = oracle_logits(model, ids, config)
    got, v = blocks_with_rollback(model, ids, config, random.Random(3), lean=True)
    assert v.history_len == len(ids) > 4 * config.budget
    assert lean.forwards > len(ids) // 8  # every block of this path is lean-sized
    assert v.backend.lean_steps > len(ids) // 8
    name = f"tiny {architecture} lean/{mode}"
    check_close(f"{name}/blocks+rollback", got, want, TOL, record_tolerance)
    got, v = token_by_token(model, ids, config)  # the default verifier: lean steps
    assert v.backend.lean_forward is lean and v.backend.lean_steps == len(ids)
    check_close(f"{name}/token-by-token", got, want, TOL, record_tolerance)
    before = lean.forwards
    rows, last, _ = chunked(model, ids, config, random.Random(4), lean=True)
    assert lean.forwards > before  # blocks of up to 16 lean, longer ones transformers'
    check_close(f"{name}/chunked", rows, want, TOL, record_tolerance)
    check_close(f"{name}/chunked append", last, want[-1], TOL, record_tolerance)


def test_lean_forward_of_the_default_model_gives_the_oracle_logits(
    default_model, text_ids, record_tolerance
):
    config = SinkWindowConfig(sink=4, window=28)
    ids = text_ids[:120]
    lean = LeanForward.of(default_model.model)
    got, v = blocks_with_rollback(default_model.model, ids, config, random.Random(5))
    assert v.history_len == len(ids) > 3 * config.budget and lean.forwards > len(ids) // 8
    assert v.backend.lean_forward is lean and v.backend.lean_steps > len(ids) // 8
    want = oracle_logits(default_model.model, ids, config)
    check_close(
        "smollm2 lean (default verifier)/global/blocks+rollback", got, want, TOL, record_tolerance
    )


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.slow
def test_split_lean_steps_run_whole_layers_compiled_and_match_the_oracle(
    default_model, text_ids, mode, record_tolerance
):
    """On ``split`` with two threads a lean step runs each layer, the first too (its block
    opened first), as one compiled call (``native/layer.cpp``; wherever the block is one run
    of slots: always in global positions, in rolling ones not when sink copies are due).
    One-token steps past eviction give the oracle's logits (the same kernel's), as the same
    steps with the layers one by one do; the two differ only in their one-row products (the
    compiled few-row product against MKL's)."""
    if instruction_set() is None:
        pytest.skip("the compiled kernels need AVX-512 or AVX2 with FMA")
    model = default_model.model
    lean = LeanForward.of(model)
    assert lean.native is not None
    layers = len(lean.layers)
    config = SinkWindowConfig(sink=4, window=28, positions=mode)
    ids = text_ids[:70]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with kernel_switched(model, "split"):
            assert all(c is not None and c.kind == "float" for c in lean.compiled_layers)
            want = oracle_logits(model, ids, config)
            before = lean.compiled_layer_calls
            got, v = token_by_token(model, ids, config)
            fused = lean.compiled_layer_calls - before
            operands, lean.compiled_layers = lean.compiled_layers, [None] * layers
            try:
                one_by_one, _ = token_by_token(model, ids, config)
            finally:
                lean.compiled_layers = operands
    finally:
        torch.set_num_threads(threads)
    assert v.history_len == len(ids) > 2 * config.budget
    most = layers * (len(ids) - 1)  # every step but the first (no storage yet)
    assert fused == most if mode == "global" else 0 < fused < most
    name = f"smollm2 split lean, compiled layers/{mode}"
    check_close(name, got, want, TOL, record_tolerance)
    check_close(f"{name}/layers one by one", one_by_one, want, TOL, record_tolerance)


def test_a_hooked_layer_keeps_its_operations_one_by_one(default_model, text_ids):
    """A forward hook on a layer's down projection sees every lean step on ``split``: that
    layer runs its operations one by one (calling the module), the others stay compiled."""
    if instruction_set() is None:
        pytest.skip("the compiled kernels need AVX-512 or AVX2 with FMA")
    model = default_model.model
    lean = LeanForward.of(model)
    seen: list[int] = []
    hook = model.model.layers[3].mlp.down_proj.register_forward_hook(
        lambda module, args, out: seen.append(out.shape[0])
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with kernel_switched(model, "split"):
            before = lean.compiled_layer_calls
            token_by_token(model, text_ids[:12], SinkWindowConfig(sink=4, window=28))
            fused = lean.compiled_layer_calls - before
    finally:
        torch.set_num_threads(threads)
        hook.remove()
    assert seen == [1] * 12  # every one-token step called the hooked module
    assert fused == (len(lean.layers) - 1) * 11  # every step but the first, all but layer 3


@pytest.mark.slow  # 21 s: the full suite runs it, not the fast loop
def test_an_int4_lean_draft_keeps_speculative_decoding_lossless_past_eviction(default_model):
    """The default model's own int4 copy drafts through the lean forward and, side by side,
    through transformers' forward: both streams are plain decoding's, over two turns of
    held-out chit-chat that outgrow a 4 + 60 cache, and the lean one accepts about as much."""
    draft = load_model(DEFAULT_MODEL, dtype=torch.float32, linear="int4", progress=False)
    config = SinkWindowConfig(sink=4, window=60)
    made: dict[str, list[DraftModelProposer]] = {"lean": [], "transformers": []}

    def factory(forward: str):
        def make() -> DraftModelProposer:
            made[forward].append(DraftModelProposer(draft.model, config, lean=forward == "lean"))
            return made[forward][-1]

        return make

    run = run_speculative(
        default_model,
        {forward: factory(forward) for forward in made},
        domain_conversations("chitchat", "dev")[:1],
        SpeculativeSettings.for_cache(config, draft_lengths=(5,), turns=2, max_new_tokens=48),
        progress=False,
    )
    assert greedy_streams_identical(run.turns)
    assert run.turns["history_len"].max() > config.budget
    for forward, proposers in made.items():
        assert proposers and all(p.describe()["forward"] == forward for p in proposers)
    lean = made["lean"][0].lean_forward
    assert lean is not None and lean.forwards > 0
    assert all(p.lean_forward is lean for p in made["lean"])  # built once per model
    turns = run.turns[run.turns["arm"] != "plain"].groupby("arm")[["accepted", "proposed"]].sum()
    rate = turns["accepted"] / turns["proposed"]
    assert rate["transformers@5"] > 0.5 and abs(rate["lean@5"] - rate["transformers@5"]) < 0.1


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "default"])
def test_the_lean_rotary_tables_are_transformers_to_the_bit(architecture, default_model):
    """:meth:`LeanForward.rope` computes the rotary tables itself where the frequencies are
    fixed (in blocks of positions, looked up, a few blocks kept): the same numbers as
    transformers' rotary module, bit for bit, at the first positions, on both sides of a
    block's edge and across it, a long session's and far past the models' trained length;
    one row, a run, or rows of several caches at once; and sessions far apart stepping in
    turn keep no more than a few blocks."""
    if architecture == "default":
        model = default_model.model
    else:
        model = tiny_random_model(architecture, seed=0).model
    lean = LeanForward(model)
    assert lean.rotary.rope_type == "default"
    x = torch.zeros(1, model.config.hidden_size)
    edge = ROPE_BLOCK
    for positions in (
        [0],
        [1],
        [edge - 1],
        [edge],
        list(range(edge, edge + 8)),
        list(range(edge - 3, edge + 5)),
        [123_457],
        list(range(1000, 1016)),
        [7, 7, 300, 2 * edge + 1, 5],
        [3, 40 * edge],
    ):
        at = torch.tensor(positions)
        for rows in (x, x.to(torch.bfloat16)):  # the tables are float32, cast as the module casts
            cos, sin = lean.rope(rows, positions)
            want_cos, want_sin = lean.rotary(rows[None], at[None])
            assert cos.shape == (len(positions), lean.head_dim) and cos.is_contiguous()
            assert cos.dtype == rows.dtype
            assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    for p in [b * edge + 5 for b in range(3 * ROPE_BLOCKS_KEPT)] * 2:  # far-apart sessions
        cos, _ = lean.rope(x, [p])
        assert torch.equal(cos, lean.rotary(x[None], torch.tensor([[p]]))[0][0])
    assert len(lean._rope_blocks) == ROPE_BLOCKS_KEPT


def test_an_opened_block_is_a_begun_forward(tiny_model, text_ids, record_tolerance):
    """``SinkWindowCache.open_block`` (how a compiled first layer starts a lean step) opens
    the block as layer 0's update would; until layer 0 is written the forward counts as
    begun: the next forward, a commit or an update out of order is refused, and a rollback
    leaves the cache as before, after which a step gives the oracle's logits."""
    from kakeya_lab import Verifier

    config = SinkWindowConfig(sink=2, window=6)
    ids = text_ids[:20]
    want = oracle_logits(tiny_model.model, ids, config)
    v = Verifier(tiny_model.model, config, lean=True)
    v.append(ids[:18])
    cache = v.backend.cache
    held = (cache.history_len, cache.cache_len, cache.cached_positions())
    cache.open_block(2)
    assert cache.pending_len == 2
    with pytest.raises(RuntimeError, match="only rollback"):
        cache.open_block(1)
    with pytest.raises(RuntimeError, match="only rollback"):
        cache.commit(2)
    with pytest.raises(RuntimeError, match="out of order"):
        cache.span_slots(1, 2)
    with pytest.raises(RuntimeError, match="out of order"):
        cache.span_slots(0, 1)  # not the opened block's length
    cache.get_mask_sizes(2, 0)  # a forward starting now must not commit the unwritten block
    assert cache.pending_len == 2
    v.rollback()
    assert (cache.history_len, cache.cache_len, cache.cached_positions()) == held
    rows = torch.stack([v.append([t]) for t in ids[18:]])
    assert v.backend.lean_steps >= 2
    check_close("tiny qwen3 lean/after an opened block", rows, want[18:], TOL, record_tolerance)


def test_models_the_lean_forward_cannot_run_keep_transformers_forward(tiny_model):
    wrapped = copy.deepcopy(tiny_random_model("llama", seed=1).model)
    layer = wrapped.model.layers[0].self_attn
    layer.q_proj = torch.nn.Sequential(layer.q_proj)  # e.g. an adapter around a projection
    assert "q_proj is a Sequential" in LeanForward.unsupported(wrapped)
    with pytest.raises(ValueError, match="does not support this model"):
        LeanForward(wrapped)
    config = SinkWindowConfig(sink=2, window=14)
    assert DraftModelProposer(wrapped, config).describe()["forward"] == "transformers"
    lean = LeanForward(tiny_model.model)
    v_cache = DraftModelProposer(tiny_model.model, config).verifier.backend.cache
    with pytest.raises(ValueError, match=f"1 to {MAX_TOKENS} tokens"):
        lean(v_cache, list(range(MAX_TOKENS + 1)), all_rows=True)
    from kakeya_lab import Verifier

    assert Verifier(wrapped, config, lean=True).backend.lean_forward is None
    assert Verifier(tiny_model.model, config, lean=True).backend.lean_forward is not None


def test_which_verifiers_run_the_lean_forward(tiny_model, text_ids, record_tolerance):
    """By default every verifier of a full-precision model runs it (and counts its steps);
    a quantised model's verifier only when asked (its lean forward packs fused copies);
    ``lean=False`` never; a hidden-state trace or a padded block take transformers'
    forward, a draft tree the lean one; a kernel changed after the verifier was built is
    picked up (repacked)."""
    from kakeya_lab import Verifier
    from kakeya_lab.linear import set_linear_kernel
    from kakeya_lab.tree import DraftTree

    model = copy.deepcopy(tiny_random_model("llama", seed=1).model)
    config = SinkWindowConfig(sink=2, window=14)
    ids = text_ids[:40]
    want = oracle_logits(model, ids, config)
    v = Verifier(model, config)
    assert v.backend.lean_forward is not None
    v.append(ids[:20])  # a long chunk: transformers' forward
    assert v.backend.lean_steps == 0
    v.trace_hidden()
    v.append(ids[20:21])  # a hidden-state trace: transformers' forward
    assert v.backend.lean_steps == 0
    v.trace = None
    v.forward_tree(DraftTree(tokens=(ids[21], ids[22]), parents=(-1, -1)))
    v.commit_path([0])
    assert v.backend.lean_steps == 1
    rows = torch.stack([v.append([t]) for t in ids[22:]])
    assert v.backend.lean_steps == 1 + len(ids) - 22
    check_close(
        "tiny llama default verifier/mixed forwards", rows, want[22:], TOL, record_tolerance
    )
    assert Verifier(model, config, lean=False).backend.lean_forward is None

    set_linear_kernel(model, "int8")
    assert Verifier(model, config).backend.lean_forward is None
    assert Verifier(model, config, lean=True).backend.lean_forward is not None
    w = Verifier(model, config, lean=True)
    set_linear_kernel(model, "aten")  # v's lean forward was built for aten: still current
    assert v.backend.lean_forward is not None and v.backend.lean_forward.current()
    w.append([ids[0]])
    assert w.backend.lean_forward.kernel == "aten"  # repacked, not the stale int8 copies
    set_linear_kernel(model, "int4")
    assert not v.backend.lean_forward.current()
    v.append([ids[0]])  # a quantised model's default verifier: transformers' forward
    assert v.backend.lean_forward is None


def test_a_lean_forward_stacks_the_projections_in_place_and_follows_replaced_weights(
    text_ids, record_tolerance, tmp_path
):
    """A full-precision lean forward runs q/k/v and gate/up as one product each over the
    layers' own weights re-laid as one tensor (no bytes added; the model still saves and
    loads as it was); a weight replaced after it was built makes it stale, and the next one
    re-lays the new weights."""
    model = copy.deepcopy(tiny_random_model("llama", seed=1).model)

    def storage_bytes() -> int:
        return sum(
            {
                p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()
            }.values()
        )

    bytes_before = storage_bytes()
    lean = LeanForward.of(model)
    attn = model.model.layers[0].self_attn
    storages = {
        p.untyped_storage().data_ptr()
        for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    }
    assert len(storages) == 1 and storage_bytes() == bytes_before
    assert LeanForward.of(model) is lean and lean.current()
    model.save_pretrained(tmp_path, safe_serialization=True)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    want_state = model.state_dict()
    assert all(torch.equal(t, want_state[k]) for k, t in saved.state_dict().items())
    config = SinkWindowConfig(sink=2, window=14)
    ids = text_ids[:30]
    want = oracle_logits(model, ids, config)
    with torch.no_grad():
        attn.q_proj.weight = torch.nn.Parameter(attn.q_proj.weight * 0.5)
    assert not lean.current()
    fresh = LeanForward.of(model)
    assert fresh is not lean and fresh.current()
    want_halved = oracle_logits(model, ids, config)
    got, v = token_by_token(model, ids, config)
    assert v.backend.lean_forward is fresh and v.backend.lean_steps == len(ids)
    name = "tiny llama lean/re-laid after a replaced weight"
    check_close(name, got, want_halved, TOL, record_tolerance)
    assert (want_halved - want).abs().max().item() > 1e-3  # the change did reach the logits


def test_a_compiled_layer_follows_a_replaced_output_weight(text_ids, record_tolerance):
    """On ``split`` with two threads, an output projection whose weight was replaced after
    the lean forward was built (not a stacked one: the forward stays current) keeps its
    layer's operations one by one, so the logits are the new weight's."""
    if instruction_set() is None:
        pytest.skip("the compiled kernels need AVX-512 or AVX2 with FMA")
    model = copy.deepcopy(tiny_random_model("llama", seed=1).model)
    config = SinkWindowConfig(sink=2, window=14)
    ids = text_ids[:30]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        set_linear_kernel(model, "split")
        lean = LeanForward.of(model)
        assert lean.compiled_layers[1] is not None
        o_proj = model.model.layers[1].self_attn.o_proj
        with torch.no_grad():
            o_proj.weight = torch.nn.Parameter(o_proj.weight * 0.5)
        assert LeanForward.of(model) is lean
        want = oracle_logits(model, ids, config)
        before = lean.compiled_layer_calls
        got, _ = token_by_token(model, ids, config)
        # layer 0 ran compiled in every step but the first (no storage yet); layer 1, whose
        # weight was replaced, one by one
        assert lean.compiled_layer_calls - before == len(ids) - 1
    finally:
        torch.set_num_threads(threads)
    check_close("tiny llama split lean/replaced output weight", got, want, TOL, record_tolerance)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_bfloat16_lean_forward_rounds_as_transformers_forward(architecture, record_tolerance):
    """In bfloat16 the lean forward rounds as transformers' does (norms in float32, then
    cast; the keys repeated for a block's grouped heads): the same blocks, commits and
    rollbacks give the same logits to within a bfloat16 step (here they are identical)."""
    model = copy.deepcopy(tiny_random_model(architecture, seed=1).model).to(torch.bfloat16)
    ids = [random.Random(2).randrange(model.config.vocab_size) for _ in range(100)]
    config = SinkWindowConfig(sink=3, window=17)
    want, _ = blocks_with_rollback(model, ids, config, random.Random(3), lean=False)
    got, v = blocks_with_rollback(model, ids, config, random.Random(3), lean=True)
    assert v.backend.lean_steps > len(ids) // 8
    check_close(f"tiny {architecture} bf16 lean vs transformers", got, want, 1e-2, record_tolerance)
