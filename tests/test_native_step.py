"""The compiled step operations (kakeya_lab/native/step.cpp) against PyTorch's: the RMSNorm,
the in-place rotary embedding and one query's attention over a cache's strided storage with
grouped heads and unseen columns; bad shapes are refused with a clear error; and the lean
forward of the default model gives the same logits through them as through PyTorch's
operations (the oracle tests in test_torch_lean.py and test_torch_batch.py run them too)."""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from oracle_cases import token_by_token

from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.backends.torch_lean import LeanForward, _rotate
from kakeya_lab.native.build import (
    HEADERS,
    SOURCES,
    build_folder,
    compiled,
    instruction_set,
    why_unavailable,
)
from kakeya_lab.native.step import move_slots, step_kernels
from kakeya_lab.reference import oracle_logits

pytestmark = pytest.mark.skipif(
    instruction_set() is None, reason="the compiled kernels need AVX-512 or AVX2 with FMA"
)


@pytest.fixture(scope="module")
def native():
    module = compiled()
    assert module is not None, why_unavailable()
    return module


def test_a_checkout_elsewhere_loads_the_same_build_without_rebuilding(native, tmp_path):
    """The module is built from copies of its sources kept in its build folder, so a copy of
    the package at another path (a second clone, a git worktree) loads that build as it is;
    built from each checkout's own files, PyTorch's builder would rebuild it (about a
    minute) whenever another checkout had built it last."""
    folder = build_folder()
    assert Path(native.__file__).parent == folder
    for source in [*SOURCES, *HEADERS]:
        assert (folder / "src" / source.name).read_bytes() == source.read_bytes()
    built = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix in (".so", ".o")}
    package = SOURCES[0].parents[1]
    shutil.copytree(package, tmp_path / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    script = (
        "import kakeya_lab; from kakeya_lab.native.build import compiled, why_unavailable; "
        "m = compiled(); assert m is not None, why_unavailable(); "
        "print(kakeya_lab.__file__); print(m.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600, check=True,
    ).stdout.split()  # fmt: skip
    assert out[0].startswith(str(tmp_path)) and Path(out[1]).parent == folder
    after = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix in (".so", ".o")}
    assert after == built


def test_the_build_command_names_the_build_it_finds(native):
    """``python -m kakeya_lab.native.build`` (what ``make test`` runs before pytest) finds
    this process's build, says where it is, and exits 0 without rebuilding it."""
    folder = build_folder()
    built = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix == ".so"}
    proc = subprocess.run(
        [sys.executable, "-m", "kakeya_lab.native.build"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kakeya-lab: compiled kernels ({instruction_set()}) in {folder}"
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix == ".so"} == built


def test_the_build_command_says_why_there_is_no_build_and_exits_0(tmp_path):
    """Without a compiler on PATH the command says so in its one line and still exits 0:
    every caller then runs PyTorch's operations, and ``make test`` goes on."""
    proc = subprocess.run(
        [sys.executable, "-m", "kakeya_lab.native.build"],
        env={**os.environ, "PATH": str(tmp_path)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "kakeya-lab: compiled kernels unavailable here: no c++ or ninja on PATH"
    )


def test_rms_norm_is_pytorchs(native):
    torch.manual_seed(0)
    for n, width in ((1, 576), (3, 64), (8, 896)):
        x, weight = torch.randn(n, width) * 3, torch.randn(width)
        want = F.rms_norm(x, (width,), weight, 1e-5)
        assert (native.rms_norm(x, weight, 1e-5) - want).abs().max() <= 1e-5
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.rms_norm(torch.randn(1, 40), torch.randn(40), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        native.rms_norm(torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(64), 1e-5)


def test_rotate_turns_the_first_heads_in_place_as_rotate_half_does(native):
    torch.manual_seed(1)
    n, heads, total, d = 3, 12, 15, 64
    rows = torch.randn(n, total, d)
    angles = torch.randn(n, d)
    cos, sin = angles.cos(), angles.sin()
    want = _rotate(rows[:, :heads].transpose(0, 1), cos, sin).transpose(0, 1)
    kept = rows[:, heads:].clone()
    native.rotate_(rows, cos, sin, heads)
    assert (rows[:, :heads] - want).abs().max() <= 1e-6
    assert torch.equal(rows[:, heads:], kept)  # the value heads are left alone
    with pytest.raises(RuntimeError, match="cos and sin"):
        native.rotate_(rows, cos[:2], sin[:2], heads)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 128), (14, 2, 64)])
@pytest.mark.parametrize(
    ("n", "columns"), [(1, 1), (1, 37), (1, 700), (1, 1300), (5, 40), (8, 700)]
)
def test_queries_attend_as_sdpa_over_strided_storage_and_a_mask(
    native, heads, kv_heads, d, n, columns
):
    """Keys and values are a slice of a larger slot storage (as a cache returns them), the
    queries a strided view (as the lean forward's q heads are), the query heads grouped onto
    the key heads; with a mask each query leaves some columns unseen (a block's causal
    layout: query r sees the columns up to its own, some earlier ones masked too; or only the
    last 90 columns, so that whole spans are unseen); past a few hundred columns the keys
    are split into spans whose partial sums are merged."""
    torch.manual_seed(columns + heads + n)
    storage_k, storage_v = torch.randn(2, 1, kv_heads, columns + 9, d)
    keys, values = storage_k[:, :, :columns], storage_v[:, :, :columns]
    q = torch.randn(n, heads + 2, d).transpose(0, 1)[:heads]  # [heads, n, d], strided
    seen = torch.rand(n, columns) > 0.3
    own = torch.arange(columns - n, columns)
    seen[torch.arange(n), own] = True
    seen &= torch.arange(columns)[None] <= own[:, None]
    recent = (torch.arange(columns)[None] >= own[:, None] - 90) & (
        torch.arange(columns)[None] <= own[:, None]
    )
    for mask in (None, seen, recent):
        want = (
            F.scaled_dot_product_attention(
                q[None],
                keys,
                values,
                attn_mask=None if mask is None else mask[None, None],
                scale=d**-0.5,
                enable_gqa=heads != kv_heads,
            )[0]
            .transpose(0, 1)
            .reshape(n, heads * d)
        )
        got = native.attend(q, keys, values, mask, d**-0.5)
        assert got.shape == (n, heads * d)
        assert (got - want).abs().max() <= 1e-5, mask is None
        if mask is not None and (~mask.any(0)).any():
            # slots no query sees may hold anything (free cache slots): NaN changes nothing
            hidden = ~mask.any(0)
            nan_keys, nan_values = keys.clone(), values.clone()
            nan_keys[:, :, hidden] = float("nan")
            nan_values[:, :, hidden] = float("nan")
            assert torch.equal(native.attend(q, nan_keys, nan_values, mask, d**-0.5), got)
    unseen = seen.clone()
    unseen[-1] = False
    with pytest.raises(RuntimeError, match=f"query {n - 1} sees no column"):
        native.attend(q, keys, values, unseen, 0.1)
    with pytest.raises(RuntimeError, match="bool mask"):
        native.attend(q, keys, values, seen[:, :-1].contiguous(), 0.1)
    with pytest.raises(RuntimeError, match="head sizes"):
        native.attend(torch.randn(heads + 1, n, d), keys, values, None, 0.1)
    wide = torch.randn(1, kv_heads, columns, 144)  # past the 128 numbers a head may have
    with pytest.raises(RuntimeError, match="at most 128"):
        native.attend(torch.randn(heads, n, 144), wide, wide, None, 0.1)


def test_several_caches_attend_in_one_call_as_each_does_alone(native):
    """attend_many writes each cache's block of keys and values into its own storage (slots
    start..start + n of a larger capacity) and gives each cache's rows what attend gives
    them over that storage's first columns: caches of different fill levels, blocks of
    one to several rows, with and without a mask, in one call."""
    torch.manual_seed(7)
    heads, kv_heads, d = 9, 3, 64
    caches = [(1, 37, 80), (4, 700, 760), (1, 1, 16), (3, 300, 400)]  # rows, columns, capacity
    rows = sum(n for n, _, _ in caches)
    packed = torch.randn(rows, heads + 2 * kv_heads, d).transpose(0, 1)  # as qkv gives them
    q, k, v = packed[:heads], packed[heads : heads + kv_heads], packed[heads + kv_heads :]
    keys = [torch.randn(1, kv_heads, cap, d) for _, _, cap in caches]
    values = [torch.randn(1, kv_heads, cap, d) for _, _, cap in caches]
    bounds, starts, columns, masks = [0], [], [], []
    for n, cols, _ in caches:
        bounds.append(bounds[-1] + n)
        starts.append(cols - n)
        columns.append(cols)
        mask = torch.arange(cols)[None] <= torch.arange(cols - n, cols)[:, None]
        masks.append(None if n == 1 else mask.contiguous())
    want_keys = [t.clone() for t in keys]
    want_values = [t.clone() for t in values]
    want = []
    for i, (n, cols, _) in enumerate(caches):
        a, b = bounds[i], bounds[i + 1]
        want_keys[i][0, :, starts[i] : starts[i] + n] = k[:, a:b]
        want_values[i][0, :, starts[i] : starts[i] + n] = v[:, a:b]
        want.append(
            native.attend(
                q[:, a:b],
                want_keys[i][:, :, :cols],
                want_values[i][:, :, :cols],
                masks[i],
                d**-0.5,
            )
        )
    out = torch.empty(rows, heads * d)
    native.attend_many(out, q, k, v, keys, values, bounds, starts, columns, masks, d**-0.5)
    for got_k, want_k, got_v, want_v in zip(keys, want_keys, values, want_values):
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(out, torch.cat(want))
    with pytest.raises(RuntimeError, match="must fit"):
        native.attend_many(
            out, q, k, v, keys, values, bounds, starts, [80, 700, 1, 401], masks, d**-0.5
        )


def test_slot_moves_of_every_layer_in_one_call_are_indexings(native):
    """``move_slots`` moves as ``storage[:, :, dst] = storage[:, :, src]`` does, in several
    storages of different dtypes and head counts, also where a destination is a later move's
    source (every source read first); a bad slot or storage is refused before anything
    moves."""
    gen = torch.Generator().manual_seed(0)
    storages = [
        torch.randn(1, 3, 40, 64, generator=gen),
        torch.randn(1, 3, 40, 64, generator=gen),
        torch.randn(1, 2, 40, 16, generator=gen).to(torch.bfloat16),
    ]
    src = torch.tensor([39, 5, 38, 7])
    dst = torch.tensor([5, 12, 7, 0])  # 5 and 7 are written and read
    expected = [t.clone() for t in storages]
    for t in expected:
        t[:, :, dst] = t[:, :, src]
    assert move_slots(storages, src, dst)
    for got, want in zip(storages, expected, strict=True):
        assert torch.equal(got, want)
    before = [t.clone() for t in storages]
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.move_slots(storages, src, torch.tensor([5, 12, 7, 40]))
    with pytest.raises(RuntimeError, match="storage"):
        native.move_slots([storages[0], torch.zeros(3, 40, 64)], src, dst)
    assert all(torch.equal(a, b) for a, b in zip(storages, before, strict=True))
    # what it does not take is left to the caller
    assert not move_slots([storages[0].transpose(2, 3)], src, dst)
    assert not move_slots(storages, src.int(), dst)
    assert all(torch.equal(a, b) for a, b in zip(storages, before, strict=True))


def test_a_real_cache_past_eviction_moves_through_it(tiny_model):
    """The storages of a verifier's cache that has evicted (every layer's keys and values)
    are what ``move_slots`` takes, so eviction's moves go through it rather than the
    indexing fallback, and it moves them as the indexing does."""
    v = Verifier(tiny_model.model, SinkWindowConfig(sink=2, window=8))
    for t in range(100, 116):
        v.append([t])
    assert v.cache_len == 10 and v.history_len == 16  # evicted at every step past 10
    storages = [t for layer in v.backend.cache.sink_window_layers for t in layer.storage()]
    assert len(storages) == 2 * len(v.backend.cache.sink_window_layers)
    src, dst = torch.tensor([9, 3]), torch.tensor([2, 9])
    expected = [t.clone() for t in storages]
    for t in expected:
        t[:, :, dst] = t[:, :, src]
    assert move_slots(storages, src, dst)
    for got, want in zip(storages, expected, strict=True):  # slots never written hold anything
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_the_step_kernels_take_float32_cpu_rows_of_widths_in_sixteens():
    cpu = torch.device("cpu")
    kernels = step_kernels(torch.float32, cpu, 576, 64)
    assert kernels is not None
    # a model deep-copied or pickled with its lean forward takes them along
    assert copy.deepcopy(kernels) == kernels == pickle.loads(pickle.dumps(kernels))
    assert step_kernels(torch.bfloat16, cpu, 576, 64) is None
    assert step_kernels(torch.float32, cpu, 576, 24) is None
    assert step_kernels(torch.float32, cpu, 576, 256) is None  # heads past 128: PyTorch's
    assert step_kernels(torch.float32, torch.device("meta"), 576, 64) is None


@pytest.mark.slow
def test_the_default_models_lean_steps_through_them_are_pytorchs_past_eviction(
    default_model, text_ids, record_tolerance
):
    """Token by token past eviction in rolling positions (masked columns at every step), the
    compiled operations and PyTorch's give the same greedy tokens and logits within the
    oracle tests' 1e-4 of each other (two float32 roundings of one forward), and each within
    1e-4 of the dense oracle."""
    model = default_model.model
    config = SinkWindowConfig(sink=2, window=30, positions="rolling")
    ids = text_ids[:90]
    lean = LeanForward.of(model)
    assert lean.native is not None  # the default path here runs them
    got, v = token_by_token(model, ids, config)
    assert v.backend.lean_forward is lean and v.backend.lean_steps == len(ids)
    plain = LeanForward(model, compiled=False)
    assert plain.native is None
    model.__dict__["_lean_forward"] = plain  # what LeanForward.of returns for this model now
    try:
        want, w = token_by_token(model, ids, config)
        assert w.backend.lean_forward is plain and plain.forwards == len(ids)
    finally:
        model.__dict__["_lean_forward"] = lean
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() <= 1e-4
    oracle = oracle_logits(model, ids, config)
    for name, rows in (("compiled", got), ("pytorch", want)):
        err = (rows - oracle).abs().max().item()
        record_tolerance(f"smollm2 lean {name} step ops/rolling/token-by-token", err)
        assert err <= 1e-4, name
