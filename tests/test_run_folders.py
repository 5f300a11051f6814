"""Every notebook, executed once into a run folder with CI-sized parameters, writes a run
folder that identifies itself: ``metrics.json`` valid against the schema (model name and
weight sha256 included), the executed notebook, and its figures sharing one plotly.js.

nbval runs the notebooks with ``run_dir=None``; this is the test of their writing branch.
Notebook 20's run folder is written in ``test_notebook_served``, against a server that test
starts (the one execution checks both). Notebook 25 writes nothing of its own: 05_chat's
run is the case of a notebook without a writing branch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kakeya_lab.experiments import build_index, run_notebook
from kakeya_lab.results import PLOTLY_JS, validate_metrics

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# Small enough that the whole file runs in a few minutes on 2 cores (None: tested elsewhere).
CI_PARAMETERS: dict[str, dict | None] = {
    "05_chat": {"max_new_tokens": 6, "scripted_turns": ["Hi!", "Why?"]},
    # No writing branch (no run_dir of its own, like 05_chat, whose run covers that case):
    # nbval's execution and tests/test_browser.py are its tests.
    "25_monitor": None,
    "00_quickstart": {"turns": 5, "max_new_tokens": 6, "window": 60},
    "15_mlx_backend": {
        "oracle_tokens": 48,
        "anchor_window": 20,
        "anchor_new_tokens": 12,
        "timing_window": 60,
        "timing_steps": 3,
        "timing_rounds": 1,
    },
    "10_sink_window_cache": {"n_tokens": 200, "window": 60, "chunk": 32, "stride": 32, "smooth": 8},
    "20_long_run": None,  # tests/test_notebook_served.py
    "30_speculative": {
        "plain_kernels": ["aten"],  # beside the model's own "auto"
        "proposers": ["ngram"],
        "draft_lengths": [2],
        "conversations": 1,
        "turns": 1,
        "max_new_tokens": 12,
    },
    "35_spec_table": {
        "arms": ["ngram@2", "suffix-tree@3"],
        "prompt_sets": ["code-dev", "chitchat-dev"],
        "max_new_tokens": 8,
    },
    "40_proposer_alignment": {
        "domains": ["chitchat"],
        "train_conversations": 2,
        "dev_conversations": 1,
        "capture_max_new_tokens": 12,
        "drafters": ["feature"],
        "steps": {"feature": 6},
        "eval_max_new_tokens": 12,
        "draft_lengths": [4],
        "plain_kernels": ["aten"],  # beside the verifier's own "auto"
    },
    "90_report": {},
}


def test_every_notebook_has_ci_parameters():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(CI_PARAMETERS)


@pytest.fixture(scope="module")
def results_root(tmp_path_factory):
    return tmp_path_factory.mktemp("results")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, p in CI_PARAMETERS.items() if p is not None))
def test_notebook_run_folder_identifies_itself(name, results_root):
    params = dict(CI_PARAMETERS[name] or {})
    if name == "90_report":
        params["results_root"] = str(results_root)
    run_dir = run_notebook(
        NOTEBOOKS / f"{name}.ipynb", params, results_root=results_root, progress=False
    )
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "completed" and record["parameters"] == params
    assert (run_dir / "notebook.ipynb").stat().st_size > 0
    assert not list(run_dir.glob(".*.tmp"))
    if name == "90_report":  # reads the others' folders; writes no metrics of its own
        index = build_index(results_root)
        assert len(index) >= 1
        return
    if name == "05_chat":  # a demo: the executed notebook is its record
        return
    doc = json.loads((run_dir / "metrics.json").read_text())
    validate_metrics(doc)
    assert doc["experiment"] == record["experiment"] and doc["run_id"] == record["run_id"]
    assert doc["model"]["name"] == "smollm2-135m-instruct" and doc["model"]["random"] is False
    if name == "30_speculative":  # every speedup against the fastest plain decoding tried
        rates = doc["plain_tokens_per_s"]
        assert doc["linear"] == "auto" and sorted(rates) == ["aten", "auto"]
        assert doc["plain_kernel"] == max(rates, key=rates.get)
    if name == "40_proposer_alignment":
        assert doc["settings"]["linear"] == "auto" and doc["settings"]["plain_kernels"] == ["aten"]
    if name == "35_spec_table":
        assert doc["linear"] == "auto" and set(doc["plain_kernel"]) == {"code", "chitchat"}
    check_figures(run_dir, results_root)


def check_figures(run_dir: Path, results_root: Path) -> None:
    """The run folder holds figures, each loading the one plotly.js of ``results_root``."""
    figures = list(run_dir.glob("*.html"))
    assert figures, f"{run_dir.name} wrote no figures"
    for html in figures:
        assert f'src="../../{PLOTLY_JS}"' in html.read_text()
    assert (results_root / PLOTLY_JS).is_file() and not list(run_dir.glob("*.js"))
