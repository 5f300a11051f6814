"""``linear="auto"`` (kakeya_lab/linear_auto.py): measured once per model and machine, cached on
disk and reused, measured again for another key or a broken file, dispatched per row count,
and the oracle's logits through it; plain decoding timed on every kernel in a speculative
run, the fastest as the baseline. Which kernel wins is this machine's business, so no test
asserts a winner."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import pytest
import torch
from oracle_cases import blocks_with_rollback, check_close, token_by_token

from kakeya_lab import SinkWindowConfig, linear_auto
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.data import domain_conversations
from kakeya_lab.linear import (
    FEW_ROWS,
    AutoLinear,
    OneDNNLinear,
    kernel_switched,
    linear_kernel_of,
    set_linear_kernel,
)
from kakeya_lab.linear_auto import full_precision_kernels, set_auto_kernel
from kakeya_lab.models import tiny_random_model
from kakeya_lab.proposers import make_proposer
from kakeya_lab.reference import oracle_logits

TOL = 1e-4


@pytest.fixture
def model():
    return copy.deepcopy(tiny_random_model("llama", seed=1).model)


def _files(folder):
    return sorted(folder.glob("linear-*.json"))


def test_the_choice_is_measured_once_then_read_from_the_cache(model, tmp_path):
    before = linear_auto.measurements
    assert set_auto_kernel(model, cache_dir=tmp_path) > 0
    first = model.linear_auto_choice
    assert linear_auto.measurements == before + 1 and not first.cached
    assert linear_kernel_of(model) == "auto"
    (path,) = _files(tmp_path)
    saved = json.loads(path.read_text())
    assert saved["key"]["cpu"] and saved["key"]["threads"] == torch.get_num_threads()
    assert len(first.few) == FEW_ROWS and set(first.ms) == set(full_precision_kernels())
    assert "1: " in first.describe() and "prefill: " in first.describe()
    # more rows (prefills, a new row count with every prompt length): the fastest kernel
    # that keeps no state per row count
    stateless = [k for k in first.ms if k not in linear_auto.PER_SHAPE_STATE]
    assert first.many == min(stateless, key=lambda k: first.ms[k]["prefill"])

    set_linear_kernel(model, "aten")
    set_auto_kernel(model, cache_dir=tmp_path)  # the second call reads the file
    assert linear_auto.measurements == before + 1 and model.linear_auto_choice.cached
    assert model.linear_auto_choice.few == first.few and model.linear_auto_choice.many == first.many


@pytest.mark.slow
def test_a_file_of_another_cpu_or_a_broken_file_is_measured_again(model, tmp_path):
    set_auto_kernel(model, cache_dir=tmp_path)
    (path,) = _files(tmp_path)
    before = linear_auto.measurements
    other_cpu = json.loads(path.read_text())
    other_cpu["key"]["cpu"] = "another CPU"
    for broken in (json.dumps(other_cpu), "{not json", json.dumps({"few": ["aten"]}), ""):
        path.write_text(broken)
        set_auto_kernel(model, cache_dir=tmp_path)
        assert not model.linear_auto_choice.cached
        assert json.loads(path.read_text())["key"]["cpu"] != "another CPU"  # rewritten
    assert linear_auto.measurements == before + 4
    threads = torch.get_num_threads()
    try:  # another thread count is another key: a second file
        torch.set_num_threads(threads + 1)
        set_auto_kernel(model, cache_dir=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert linear_auto.measurements == before + 5 and len(_files(tmp_path)) == 2


def test_the_cached_choice_decides_each_row_count(model, tmp_path):
    """A cache file decides the dispatch (no measurement): here oneDNN for odd row counts
    and for prefills, PyTorch's default otherwise."""
    set_auto_kernel(model, cache_dir=tmp_path)
    (path,) = _files(tmp_path)
    data = json.loads(path.read_text())
    data["few"] = ["onednn" if r % 2 else "aten" for r in range(1, FEW_ROWS + 1)]
    data["many"] = "onednn"
    path.write_text(json.dumps(data))
    before = linear_auto.measurements
    set_auto_kernel(model, cache_dir=tmp_path)
    assert linear_auto.measurements == before
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, AutoLinear)
    assert [model.linear_auto_choice.kernel_for(r) for r in (1, 2, 3, 9)] == [
        "onednn",
        "aten",
        "onednn",
        "onednn",
    ]
    for rows in (1, 2, 3, 20):
        x = torch.randn(rows, layer.in_features)
        with torch.inference_mode():
            got = layer(x)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.slow
def test_auto_gives_the_oracle_logits_past_eviction(model, tmp_path, mode, record_tolerance):
    set_auto_kernel(model, cache_dir=tmp_path)
    config = SinkWindowConfig(sink=3, window=17, positions=mode)
    ids = [random.Random(2).randrange(model.config.vocab_size) for _ in range(90)]
    want = oracle_logits(model, ids, config)
    got, v = token_by_token(model, ids, config)
    assert v.backend.lean_steps == len(ids)  # auto is full precision: the lean step runs
    check_close(f"tiny llama auto/{mode}/token-by-token", got, want, TOL, record_tolerance)
    got, _ = blocks_with_rollback(model, ids, config, random.Random(3))
    check_close(f"tiny llama auto/{mode}/blocks+rollback", got, want, TOL, record_tolerance)


def test_kernel_switched_restores_every_layer(model, tmp_path):
    set_auto_kernel(model, cache_dir=tmp_path)
    with kernel_switched(model, "onednn"):
        assert isinstance(model.model.layers[0].mlp.down_proj, OneDNNLinear)
        assert linear_kernel_of(model) == "onednn"
    assert linear_kernel_of(model) == "auto"
    with pytest.raises(ValueError, match="full-precision"):
        with kernel_switched(model, "int4"):
            pass


def test_plain_decoding_on_every_kernel_the_fastest_is_the_baseline(tiny_model):
    """Each kernel's plain arm emits the same stream; the fastest is named ``plain`` and
    every speedup is against it; the run says which kernel that was."""
    config = SinkWindowConfig(sink=4, window=28)
    settings = SpeculativeSettings.for_cache(
        config,
        draft_lengths=(4,),
        turns=1,
        max_new_tokens=16,
        measure_cost=False,
        plain_kernels=("aten", "onednn"),
    )
    run = run_speculative(
        tiny_model,
        {"ngram": lambda: make_proposer("ngram")},
        domain_conversations("chitchat", "dev")[:1],
        settings,
        progress=False,
    )
    arms = set(run.turns["arm"])
    other = {"aten": "onednn", "onednn": "aten"}[run.plain_kernel]
    assert {"plain", f"plain[{other}]", "ngram@4"} <= arms
    assert greedy_streams_identical(run.turns)
    rates = run.plain_tokens_per_s
    assert rates is not None and rates[run.plain_kernel] == max(rates.values())
    plain = run.summary.set_index("arm")
    assert plain.loc["plain", "speedup"] == pytest.approx(1.0)
    assert plain.loc[f"plain[{other}]", "speedup"] <= 1.0
    assert f"the fastest ({run.plain_kernel}) is the baseline" in run.baseline()
    # a backend with no torch kernels (MLX: its plain arm's kernel is "") says nothing
    assert dataclasses.replace(run, plain_kernel="", plain_tokens_per_s={"": 1.0}).baseline() == ""


def test_auto_without_a_measured_choice_is_refused_before_anything_changes(model):
    set_linear_kernel(model, "onednn")
    with pytest.raises(ValueError, match="set_auto_kernel"):
        set_linear_kernel(model, "auto")
    assert linear_kernel_of(model) == "onednn"


def test_split_is_a_candidate_only_with_threads_to_split_over():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert "split" not in full_precision_kernels() and "aten" in full_precision_kernels()
        torch.set_num_threads(2)
        assert "split" in full_precision_kernels()
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_models_kernels_shows_the_choice_measures_it_once_and_again_on_request(
    tmp_path, monkeypatch, capsys
):
    """``kakeya-lab models kernels``: every kernel's time per row count with auto's choice
    marked, measured into ``$KAKEYA_LAB_KERNELS`` when absent, read back the next time,
    measured again with ``--measure`` (a name that is no model: tests/test_cli.py). On a
    tiny random model's folder (the mechanics; ``make test`` runs it on the default model
    before pytest, whose measurement takes half a minute)."""
    from kakeya_lab.cli import main

    tiny = tiny_random_model("llama", seed=1)
    folder = tmp_path / "tiny"
    tiny.model.save_pretrained(folder, safe_serialization=True)
    tiny.tokenizer.save_pretrained(folder)
    cache = tmp_path / "kernels"
    monkeypatch.setenv("KAKEYA_LAB_KERNELS", str(cache))
    before = linear_auto.measurements
    assert main(["models", "kernels", str(folder)]) == 0
    first = capsys.readouterr().out
    (path,) = _files(cache)
    saved = json.loads(path.read_text())
    assert "measured now, cached in" in first and str(path) in first
    lines = first.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("rows"))) + 2 :][:17]
    assert [row.split()[0] for row in table] == [*map(str, range(1, FEW_ROWS + 1)), "prefill"]
    for row, chosen in zip(table, [*saved["few"], saved["many"]]):  # the marked time: auto's
        marked = row.split("*")[0].split()[-1]
        assert row.count("*") == 1 and marked == f"{saved['ms'][chosen][row.split()[0]]:.1f}", row
    assert main(["models", "kernels", str(folder)]) == 0
    assert "read from" in capsys.readouterr().out
    assert linear_auto.measurements == before + 1
    assert main(["models", "kernels", str(folder), "--measure"]) == 0
    assert "measured now" in capsys.readouterr().out and linear_auto.measurements == before + 2


def test_a_choices_summary_groups_row_counts_by_kernel():
    """What the ready line and chat's header print: runs of row counts on one kernel."""
    few = ("exact",) * 8 + ("split",) + ("exact",) * 6 + ("onednn",)
    ms = {k: {label: 1.0 for label in linear_auto._labels()} for k in ("exact", "split")}
    choice = linear_auto.AutoChoice(few, "aten", ms, key={})
    assert choice.summary() == (
        "exact for 1-8 rows, split for 9 rows, exact for 10-15 rows, onednn for 16 rows, "
        "aten beyond"
    )
    one = linear_auto.AutoChoice(("aten",) + ("exact",) * 15, "split", ms, key={})
    assert one.summary() == "aten for 1 row, exact for 2-16 rows, split beyond"
