"""The long-run benchmark on the MLX backend: the same driver, arms and records as on torch.

A short run of the default model past eviction on both backends: the MLX sink-window arm
holds exactly the analytic KV budget once full, and its greedy replies equal the torch
run's (or the first differing token is a near-tie in the torch logits, shown).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("mlx_lm")

from kakeya_lab import SinkWindowConfig, Verifier  # noqa: E402
from kakeya_lab.backends.config import analytic_kv_budget_bytes  # noqa: E402
from kakeya_lab.bench.long_run import LongRunSettings, run_long  # noqa: E402
from kakeya_lab.data import chained_user_turns, chitchat_conversations  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL, load_model  # noqa: E402

SINK, WINDOW = 4, 40
TURNS, NEW = 6, 8
NEAR_TIE = 2e-3  # twice the SmolLM2 torch-vs-MLX logit tolerance


@pytest.fixture(scope="module")
def runs(aten_model):
    mlx = load_model(DEFAULT_MODEL, backend="mlx", progress=False)
    turns = chained_user_turns(chitchat_conversations("dev"), TURNS)
    out = {}
    for name, loaded in (("torch", aten_model), ("mlx", mlx)):
        settings = LongRunSettings(
            arms=("sink_window",),
            sink=SINK,
            window=WINDOW,
            turns=TURNS,
            max_new_tokens=NEW,
            probe_every=0,
            backend=name,
        )
        out[name] = (loaded, run_long(loaded, settings, turns, progress=False))
    return out


@pytest.mark.slow  # the default model on both backends, six turns each
def test_mlx_long_run_is_bounded_at_the_analytic_budget(runs):
    loaded, run = runs["mlx"]
    assert loaded.description.backend == "mlx"
    config = SinkWindowConfig(sink=SINK, window=WINDOW)
    budget = analytic_kv_budget_bytes(loaded.model, config)
    torch_budget = analytic_kv_budget_bytes(runs["torch"][0].model, config)
    assert (
        budget
        == torch_budget
        == config.budget
        * loaded.description.num_layers
        * (loaded.description.num_kv_heads * loaded.description.head_dim * 4 * 2)
    )
    t = run.turns
    assert (t["error"].isna()).all()
    full = t[t["cache_len"] == config.budget]
    assert len(full) >= 3, "the run must go past eviction for several turns"
    assert (full["kv_live_bytes"] == budget).all()
    assert (t["kv_live_bytes"] <= budget).all()
    assert t["history_len"].iloc[-1] > 3 * config.budget
    # same rows as torch: same cache and history lengths turn by turn
    tt = runs["torch"][1].turns
    assert t["cache_len"].tolist() == tt["cache_len"].tolist()
    assert t["kv_live_bytes"].tolist() == tt["kv_live_bytes"].tolist()


@pytest.mark.slow
def test_mlx_long_run_replies_equal_torch(runs):
    torch_loaded, torch_run = runs["torch"]
    _, mlx_run = runs["mlx"]
    ids = {name: run.states["sink_window"].history_ids for name, (_, run) in runs.items()}
    replies = {name: run.turns["reply"].tolist() for name, (_, run) in runs.items()}
    if ids["torch"] == ids["mlx"]:
        assert replies["torch"] == replies["mlx"]
        print(f"torch and MLX long runs: {TURNS} greedy replies equal")
        return
    i = next(j for j, (a, b) in enumerate(zip(ids["torch"], ids["mlx"])) if a != b)
    # the torch logits that chose token i, replayed through the same sink-window cache
    v = Verifier(torch_loaded.model, SinkWindowConfig(sink=SINK, window=WINDOW))
    logits = v.append(ids["torch"][:i])
    top2 = torch.topk(logits, 2)
    margin = (top2.values[0] - top2.values[1]).item()
    print(f"torch and MLX long runs first differ at history token {i}: top-2 margin {margin:.3e}")
    assert margin <= NEAR_TIE, f"not a near-tie: margin {margin:.3e} at history token {i}"


@pytest.mark.slow  # a CLI subprocess
def test_long_run_backend_flag_is_for_in_process_arms(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kakeya_lab.cli",
            "long-run",
            str(tmp_path / "x"),
            "--endpoint",
            "grpc://127.0.0.1:1",
            "--endpoint",
            "http://127.0.0.1:2",
            "--backend",
            "mlx",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--backend is for in-process arms" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_run_header_records_the_model_backend():
    from kakeya_lab.results import run_header

    model = {"name": "m", "weight_sha256": "0" * 64, "random": False, "backend": "mlx"}
    assert run_header(experiment="x", run_id="r", model=model)["backend"] == "mlx"
    assert (
        run_header(experiment="x", run_id="r", model={**model, "backend": None})["backend"]
        == "torch"
    )
    assert (
        run_header(experiment="x", run_id="r", model=model, backend="torch")["backend"] == "torch"
    )
