"""A sweep file and its runs: :class:`Sweep` (a notebook, a parameter grid, repeats,
profiles, an executor), :func:`load_sweep`, the deterministic :func:`run_id_for` and
:func:`execute_run` (one run into its folder, a failure recorded in its ``run.json``).
:mod:`kakeya_lab.experiments.sweeps` plans and executes whole sweeps with them, locally or
on Ray (:mod:`kakeya_lab.experiments.ray_executor`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kakeya_lab.durable import write_json_atomic
from kakeya_lab.experiments.runner import RunFailed, notebook_sha256, params_digest, run_notebook
from kakeya_lab.results import now_iso


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
