"""Sweeps: a notebook run over a parameter grid, locally or on a Ray cluster.

A sweep is a YAML file: a notebook, a parameter grid, repeats, named profiles
(``smoke`` / ``full``) and an executor (``local``, or ``ray``, see
:mod:`kakeya_lab.experiments.ray_executor`). Each run goes to
``results/<sweep>/<run-id>/`` with a deterministic run id (a hash of its parameters), so a
re-run skips completed runs; a failing run is recorded (``run.json`` with the error) and the
sweep goes on; ``results/index.parquet`` lists every run.

Strict resume: a completed run is skipped only if it ran the same notebook (same file
bytes) with the same parameters. Otherwise :func:`run_sweep` refuses with
:class:`ResumeMismatch`, naming the difference; ``force_new=True`` re-runs everything into
fresh folders (the old run folders of this sweep are replaced).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from kakeya_lab.experiments.index import build_index
from kakeya_lab.experiments.runner import notebook_sha256
from kakeya_lab.experiments.sweep_runs import Sweep, execute_run, load_sweep, run_id_for
from kakeya_lab.resume import ResumeMismatch, differences


def _run_record(run_dir: Path) -> dict | None:
    record = run_dir / "run.json"
    if not record.is_file():
        return None
    try:
        return json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _check_same_run(run_dir: Path, record: dict, notebook: Path, parameters: dict) -> None:
    """Refuse to skip or extend a run folder that another notebook or parameters made."""
    expected = {"notebook_sha256": notebook_sha256(notebook), "parameters": parameters}
    found = {
        "notebook_sha256": record.get("notebook_sha256"),
        "parameters": record.get("parameters"),
    }
    diff = differences(found, json.loads(json.dumps(expected, default=str)))
    if diff:
        raise ResumeMismatch(
            f"{run_dir} was run with other settings ({diff}); pass force_new "
            "(kakeya-lab sweep --force-new) or use another --results folder"
        )


def run_sweep(
    sweep: Sweep | str | Path,
    *,
    profile: str | None = None,
    results_root: str | Path = "results",
    executor: str | None = None,
    ray_address: str | None = None,
    progress: bool = True,
    force_new: bool = False,
) -> pd.DataFrame:
    """Execute every run of ``sweep`` not completed yet; failures are recorded and the
    sweep goes on. Returns one row per run (``status``: completed / failed / skipped) and
    rewrites ``results/index.parquet``.

    Raises :class:`ResumeMismatch` (before running anything) if a run folder of this sweep
    holds a run of another notebook version or other parameters; ``force_new`` replaces
    such folders instead.
    """
    if not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    executor = executor or sweep.executor
    if executor not in ("local", "ray"):
        raise ValueError(f"unknown executor {executor!r}: use 'local' or 'ray'")
    results_root = Path(results_root)
    plan = []
    for run in sweep.runs(profile):
        run_id = run_id_for(run["parameters"], run["repeat"])
        run_dir = results_root / sweep.name / run_id
        record = _run_record(run_dir)
        if record is not None and force_new:
            shutil.rmtree(run_dir)
            record = None
        if record is not None:
            _check_same_run(run_dir, record, sweep.notebook, run["parameters"])
        done = record is not None and record.get("status") == "completed"
        plan.append((run, run_id, done))
    outcomes = [
        {"run_id": rid, "status": "skipped", "run_dir": str(results_root / sweep.name / rid)}
        for _, rid, done in plan
        if done
    ]
    todo = [(run, rid) for run, rid, done in plan if not done]
    bar = tqdm(
        total=len(plan),
        initial=len(plan) - len(todo),
        desc=f"sweep {sweep.name}",
        unit="run",
        disable=not progress,
    )
    if executor == "local":
        for run, rid in todo:
            outcomes.append(
                execute_run(
                    str(sweep.notebook), run["parameters"], str(results_root), sweep.name, rid
                )
            )
            bar.update(1)
            bar.set_postfix(failed=sum(o["status"] == "failed" for o in outcomes))
    else:
        from kakeya_lab.experiments.ray_executor import run_on_ray

        outcomes += run_on_ray(sweep, todo, results_root, ray_address, bar)
    bar.close()
    build_index(results_root)
    return pd.DataFrame(outcomes)
