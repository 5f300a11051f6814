"""Every registered backend (kakeya_lab/backends/): the slot plan both caches run on, the
registry, and greedy speculative decoding equal to plain decoding past eviction on each
backend (the oracle paths are in tests/test_oracle.py, also over every backend)."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import numpy as np
import pytest

from kakeya_lab import SinkWindowConfig
from kakeya_lab.backends import registry
from kakeya_lab.backends.plan import SlotPlan, visibility
from kakeya_lab.proposers import (
    DraftModelProposer,
    EarlyExitProposer,
    make_proposer,
    proposer_kinds,
)
from kakeya_lab.session import SessionStore, Token

BACKENDS_DIR = Path(__file__).parents[1] / "kakeya_lab" / "backends"


def _plain(store, prompt, n):
    sid = store.create()
    store.append(sid, prompt)
    return [e.id for e in store.generate(sid, n) if isinstance(e, Token)]


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.parametrize(
    "proposer_kind",
    [
        # every registered model-free kind (chains and trees) runs on every backend
        *(kind.example for kind in proposer_kinds() if kind.model_free),
        pytest.param("draft_model", marks=pytest.mark.slow),
        pytest.param("early_exit", marks=pytest.mark.slow),
    ],
)
def test_greedy_speculative_equals_plain_past_eviction(backend, tiny_on, proposer_kind, mode):
    """Through the unchanged SessionStore on each backend, chains and draft trees. The
    prompt holds the verifier's own earlier continuation (P + plain(P) + P), so the
    model-free proposers have real matches to draft (a random model rarely repeats itself
    otherwise)."""
    verifier_model = tiny_on("llama", backend)
    draft_model = tiny_on("qwen3", backend)
    config = SinkWindowConfig(sink=4, window=20, positions=mode)
    rng = random.Random(11)
    first = [rng.randrange(1000, 5000) for _ in range(40)]
    store = SessionStore(verifier_model, config, capacity=8, eos_token_ids=[])
    prompt = first + _plain(store, first, 30) + first
    plain = _plain(store, prompt, 40)
    for k in (1, 4, 8):
        if proposer_kind == "draft_model":
            proposer = DraftModelProposer(draft_model, config, label=f"tiny-qwen3 ({backend})")
        elif proposer_kind == "early_exit":  # self-speculation: the first layer drafts
            proposer = EarlyExitProposer(verifier_model, config, 1)
        else:  # a registered model-free kind, from its spec (trees: one forward per tree)
            proposer = make_proposer(proposer_kind, verifier_model, config)
        sid = store.create()
        store.append(sid, prompt)
        got = [
            e.id
            for e in store.generate(sid, 40, proposer=proposer, draft_length=k)
            if isinstance(e, Token)
        ]
        assert got == plain, f"{proposer_kind} k={k}: speculative stream differs from plain"
        info = store.info(sid)
        assert info.history_len > config.budget == info.cache_len
        assert info.speculative.proposed > 0
        store.close(sid)


def _drive(plan: SlotPlan, rng: random.Random, steps: int) -> list[tuple]:
    """Random opens / commits / rollbacks / tree paths on ``plan``; what every forward
    sees, in positions: (query positions, the set of (query, key position) pairs visible,
    the sink copies' (query, source position, shift)), and the committed positions."""
    seen: list[tuple] = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.15 and not plan.pending_len:  # a draft tree: a chain of depth 2 and a leaf
            depths, ancestors = [0, 1, 1], np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
            plan.set_tree(depths, ancestors)
            block = plan.open(3)
            plan.set_tree(None)
            path = [0, 2] if rng.random() < 0.5 else [0]
            plan.select(path)
            plan.commit(len(path))
        elif op < 0.6:
            block = plan.open(rng.randint(1, 7))
        elif op < 0.85:
            plan.commit(rng.randint(0, plan.pending_len))
            continue
        else:
            plan.drop_provisional(0)
            continue
        layout = block.layout
        keys, queries = layout.key_positions, layout.query_positions
        regular = layout.visible[:, : keys.size]
        pairs = {(int(queries[q]), int(keys[c])) for q, c in zip(*np.nonzero(regular))}
        copies = set()
        if layout.copies is not None:
            sources = keys[layout.copies.column_sources]
            for q, c in zip(*np.nonzero(layout.visible[:, keys.size :])):
                copies.add((int(queries[q]), int(sources[c]), int(layout.copies.column_shifts[c])))
        seen.append((queries.tolist(), pairs, copies, plan.cached_positions()))
    return seen


@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_compact_and_free_slot_plans_show_every_query_the_same_keys(mode):
    """The torch (compact: moves on eviction) and MLX (free slots) plans differ only in
    where entries sit: every forward shows each query the same key positions, the same
    sink copies, and the same entries stay committed."""
    config = SinkWindowConfig(sink=3, window=9, positions=mode)
    runs = [_drive(SlotPlan(config, compact=c), random.Random(7), 400) for c in (True, False)]
    assert runs[0] == runs[1]
    assert max(len(s[3]) for s in runs[0]) == config.budget


def test_the_plan_applies_the_visibility_rule():
    plan = SlotPlan(SinkWindowConfig(sink=2, window=4), compact=True)
    plan.open(10)
    plan.commit(10)  # holds 0, 1 and 6..9
    assert plan.cached_positions() == [0, 1, 6, 7, 8, 9]
    layout = plan.plan(2).layout
    want = visibility(layout.query_positions, layout.key_positions, 2, 4)
    assert np.array_equal(layout.visible, want)
    assert plan.plan(2) is plan.plan(2)  # computed once per state


def test_the_registry_names_detects_and_refuses(tiny_model, tiny_on):
    assert registry.names()[:2] == ("torch", "mlx")
    assert registry.name_of(tiny_model.model) == "torch"
    assert registry.name_of(tiny_on("qwen3", "mlx")) == "mlx"
    with pytest.raises(ValueError, match="cannot tell the backend of a str"):
        registry.name_of("a model")
    with pytest.raises(ValueError, match="unknown backend 'jax'; registered: torch, mlx"):
        registry.entry("jax")


@pytest.mark.parametrize("module", ["config.py", "plan.py", "registry.py", "seam.py"])
def test_backend_neutral_modules_import_no_tensor_runtime(module):
    """Serving code and the MLX backend read these without loading torch or mlx."""
    tree = ast.parse((BACKENDS_DIR / module).read_text())
    imported = set()
    for node in tree.body:  # module level only: lazy imports inside functions are fine
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    heavy = {"torch", "mlx", "transformers", "mlx_lm"}
    assert not imported & heavy
    for name in imported:  # nor a module of the package that does
        if name.startswith("kakeya_lab.backends."):
            assert name.rsplit(".", 1)[1] in ("config", "plan", "registry", "seam"), name
