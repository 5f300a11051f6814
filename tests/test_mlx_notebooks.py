"""The quickstart notebook on the MLX backend, executed through ``kakeya-lab run`` (papermill)
with this tree first on the kernel's import path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("papermill")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # loads the default model on MLX and runs a short conversation past eviction
def test_quickstart_runs_on_mlx_and_holds_the_analytic_budget(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    params = {"backend": "mlx", "turns": "4", "window": "28", "max_new_tokens": "6"}
    args = [a for name, value in params.items() for a in ("-p", name, value)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kakeya_lab.cli",
            "run",
            "notebooks/00_quickstart.ipynb",
            *args,
            "--results",
            str(tmp_path),
            "--experiment",
            "quickstart_mlx",
            "--quiet",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "quickstart_mlx").iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["backend"] == "mlx"
    budget = metrics["metrics"]["budget_bytes"]
    head = metrics["headline"]
    assert head["sink_window"]["kv_live_bytes_last"] == budget > 0
    assert head["full_cache"]["kv_live_bytes_last"] > budget
    notebook = (run_dir / "notebook.ipynb").read_text()
    assert "cache holds sink + window = 32 entries: True" in notebook
