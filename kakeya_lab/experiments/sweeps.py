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

import itertools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from kakeya_lab.durable import write_json_atomic
from kakeya_lab.experiments.index import build_index
from kakeya_lab.experiments.runner import RunFailed, notebook_sha256, params_digest, run_notebook
from kakeya_lab.results import now_iso
from kakeya_lab.resume import ResumeMismatch, differences


@dataclass(frozen=True)
class Sweep:
    """A sweep file: ``notebook``, ``grid`` (name -> list of values), ``repeats``,
    ``profiles`` (name -> fixed parameters, e.g. ``smoke`` / ``full``), ``executor``."""

    name: str
    notebook: Path
    grid: dict[str, list]
    repeats: int = 1
    profiles: dict[str, dict] = field(default_factory=dict)
    executor: str = "local"
    ray: dict = field(default_factory=dict)

    def runs(self, profile: str | None = None) -> list[dict[str, Any]]:
        """Every run's parameters (profile defaults, then one grid point), with ``repeat``."""
        if profile is not None and profile not in self.profiles:
            raise ValueError(
                f"unknown profile {profile!r}; {self.name} has {sorted(self.profiles)}"
            )
        base = dict(self.profiles.get(profile, {})) if profile else {}
        names = list(self.grid)
        out = []
        for values in itertools.product(*(self.grid[n] for n in names)):
            params = {**base, **dict(zip(names, values))}
            for repeat in range(self.repeats):
                out.append({"parameters": params, "repeat": repeat})
        return out


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep YAML (clear errors for missing or ill-typed keys)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no sweep file at {path}")
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or "notebook" not in doc:
        raise ValueError(f"{path}: a sweep needs at least a 'notebook' key")
    notebook = (path.parent / doc["notebook"]).resolve()
    if not notebook.is_file():
        raise ValueError(
            f"{path}: notebook {doc['notebook']!r} not found (relative to the YAML file)"
        )
    grid = doc.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ValueError(f"{path}: 'grid' must map parameter names to non-empty lists")
    repeats = doc.get("repeats", 1)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"{path}: 'repeats' must be an integer >= 1")
    executor = doc.get("executor", "local")
    if executor not in ("local", "ray"):
        raise ValueError(f"{path}: executor must be 'local' or 'ray', got {executor!r}")
    profiles = doc.get("profiles") or {}
    if not isinstance(profiles, dict) or not all(isinstance(v, dict) for v in profiles.values()):
        raise ValueError(f"{path}: 'profiles' must map names to parameter dicts")
    return Sweep(
        name=doc.get("name", path.stem),
        notebook=notebook,
        grid=grid,
        repeats=repeats,
        profiles=profiles,
        executor=executor,
        ray=doc.get("ray") or {},
    )


def run_id_for(parameters: dict, repeat: int) -> str:
    """Deterministic run id: the same parameters and repeat give the same folder."""
    return f"r{repeat}-{params_digest(parameters)}"


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


def execute_run(
    notebook: str, parameters: dict, results_root: str, experiment: str, run_id: str
) -> dict:
    """One sweep run; never raises for a failing notebook (the failure is recorded)."""
    try:
        run_dir = run_notebook(
            notebook,
            parameters,
            results_root=results_root,
            experiment=experiment,
            run_id=run_id,
            progress=False,
        )
        return {"run_id": run_id, "status": "completed", "run_dir": str(run_dir)}
    except RunFailed as exc:
        return {
            "run_id": run_id,
            "status": "failed",
            "run_dir": str(exc.run_dir),
            "error": str(exc),
        }
    except ValueError as exc:  # bad parameters: recorded in a run folder of its own
        run_dir = Path(results_root) / experiment / run_id
        write_json_atomic(
            run_dir / "run.json",
            {
                "notebook": notebook,
                "notebook_sha256": notebook_sha256(notebook),
                "experiment": experiment,
                "run_id": run_id,
                "parameters": parameters,
                "status": "failed",
                "started": now_iso(),
                "ended": now_iso(),
                "error": {"type": type(exc).__name__, "message": str(exc), "traceback": None},
            },
        )
        return {"run_id": run_id, "status": "failed", "run_dir": str(run_dir), "error": str(exc)}


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
