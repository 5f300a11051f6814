"""Run parameterised notebooks into run folders (papermill), and sweeps of them.

A sweep is a YAML file: a notebook, a parameter grid, repeats, named profiles
(``smoke`` / ``full``) and an executor (``local``, or ``ray`` for a Ray cluster). Each run
goes to ``results/<experiment>/<run-id>/`` with a deterministic run id, so a re-run skips
completed runs; a failing run is recorded (``run.json`` with the error) and the sweep goes
on; ``results/index.parquet`` lists every run with its parameters and headline metrics.

A run folder ``results/<experiment>/<run-id>/`` holds the executed notebook
(``notebook.ipynb``), the notebook's own metrics JSON and figures, and ``run.json``
(what was run, with which parameters, how it ended). The notebook receives ``run_dir``,
``run_id`` and ``experiment`` as parameters besides the user's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from kakeya_lab.results import now_iso, write_json_atomic

RESERVED_PARAMETERS = ("run_dir", "run_id", "experiment")


class RunFailed(RuntimeError):
    """The notebook raised; ``run_dir`` still holds the partial notebook and ``run.json``."""

    def __init__(self, message: str, run_dir: Path):
        super().__init__(message)
        self.run_dir = run_dir


def params_digest(params: dict[str, Any]) -> str:
    """A short stable hash of a parameter dict (key order does not matter)."""
    blob = json.dumps(params, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def notebook_parameters(notebook: str | Path) -> dict[str, Any]:
    """The names and defaults of the notebook's ``parameters`` cell (papermill's inspection)."""
    import papermill as pm

    return {name: spec["default"] for name, spec in pm.inspect_notebook(str(notebook)).items()}


def run_notebook(
    notebook: str | Path,
    parameters: dict[str, Any] | None = None,
    *,
    results_root: str | Path = "results",
    experiment: str | None = None,
    run_id: str | None = None,
    progress: bool = True,
    kernel_name: str = "python3",
) -> Path:
    """Execute ``notebook`` with ``parameters`` into a new run folder; return its path.

    Unknown parameter names are an error (a typo must not silently run the defaults).
    On failure the folder keeps the partially executed notebook and ``run.json`` with the
    error, and :class:`RunFailed` is raised.
    """
    import papermill as pm

    notebook = Path(notebook)
    if not notebook.is_file():
        raise FileNotFoundError(f"no notebook at {notebook}")
    parameters = dict(parameters or {})
    declared = notebook_parameters(notebook)
    if not declared:
        raise ValueError(f"{notebook} has no cell tagged 'parameters'")
    unknown = sorted(set(parameters) - set(declared))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for {notebook.name}; it declares {sorted(declared)}"
        )
    reserved = sorted(set(parameters) & set(RESERVED_PARAMETERS))
    if reserved:
        raise ValueError(f"parameter(s) {reserved} are set by the runner")
    experiment = experiment or notebook.stem
    run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{params_digest(parameters)}"
    run_dir = Path(results_root) / experiment / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "notebook": str(notebook),
        "experiment": experiment,
        "run_id": run_id,
        "parameters": parameters,
        "status": "running",
        "started": now_iso(),
        "ended": None,
        "error": None,
    }
    write_json_atomic(run_dir / "run.json", record)
    injected = {**parameters, "run_dir": str(run_dir.resolve()), "run_id": run_id, "experiment": experiment}
    try:
        pm.execute_notebook(
            str(notebook),
            str(run_dir / "notebook.ipynb"),
            parameters=injected,
            kernel_name=kernel_name,
            progress_bar=progress,
            cwd=str(notebook.parent.resolve()),
        )
    except BaseException as exc:
        record.update(
            status="failed",
            ended=now_iso(),
            error={"type": type(exc).__name__, "message": str(exc)[-4000:],
                   "traceback": traceback.format_exc()[-8000:]},
        )
        write_json_atomic(run_dir / "run.json", record)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise RunFailed(f"{notebook.name} failed: {type(exc).__name__}: {str(exc)[-500:]}", run_dir) from exc
    record.update(status="completed", ended=now_iso())
    write_json_atomic(run_dir / "run.json", record)
    return run_dir


# ------------------------------------------------------------------------- sweeps
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
            raise ValueError(f"unknown profile {profile!r}; {self.name} has {sorted(self.profiles)}")
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
        raise ValueError(f"{path}: notebook {doc['notebook']!r} not found (relative to the YAML file)")
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
    return Sweep(name=doc.get("name", path.stem), notebook=notebook, grid=grid, repeats=repeats,
                 profiles=profiles, executor=executor, ray=doc.get("ray") or {})


def run_id_for(parameters: dict, repeat: int) -> str:
    """Deterministic run id: the same parameters and repeat give the same folder."""
    return f"r{repeat}-{params_digest(parameters)}"


def _run_status(run_dir: Path) -> str | None:
    record = run_dir / "run.json"
    if not record.is_file():
        return None
    try:
        return json.loads(record.read_text()).get("status")
    except (OSError, json.JSONDecodeError):
        return None


def _execute(notebook: str, parameters: dict, results_root: str, experiment: str, run_id: str) -> dict:
    """One sweep run; never raises for a failing notebook (the failure is recorded)."""
    try:
        run_dir = run_notebook(notebook, parameters, results_root=results_root, experiment=experiment,
                               run_id=run_id, progress=False)
        return {"run_id": run_id, "status": "completed", "run_dir": str(run_dir)}
    except RunFailed as exc:
        return {"run_id": run_id, "status": "failed", "run_dir": str(exc.run_dir), "error": str(exc)}
    except ValueError as exc:  # bad parameters: recorded in a run folder of its own
        run_dir = Path(results_root) / experiment / run_id
        write_json_atomic(run_dir / "run.json", {
            "notebook": notebook, "experiment": experiment, "run_id": run_id, "parameters": parameters,
            "status": "failed", "started": now_iso(), "ended": now_iso(),
            "error": {"type": type(exc).__name__, "message": str(exc), "traceback": None},
        })
        return {"run_id": run_id, "status": "failed", "run_dir": str(run_dir), "error": str(exc)}


def run_sweep(
    sweep: Sweep | str | Path,
    *,
    profile: str | None = None,
    results_root: str | Path = "results",
    executor: str | None = None,
    ray_address: str | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Execute every run of ``sweep`` not completed yet; failures are recorded and the
    sweep goes on. Returns one row per run (``status``: completed / failed / skipped) and
    rewrites ``results/index.parquet``."""
    if not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    executor = executor or sweep.executor
    results_root = Path(results_root)
    plan = []
    for run in sweep.runs(profile):
        run_id = run_id_for(run["parameters"], run["repeat"])
        done = _run_status(results_root / sweep.name / run_id) == "completed"
        plan.append((run, run_id, done))
    outcomes = [{"run_id": rid, "status": "skipped", "run_dir": str(results_root / sweep.name / rid)}
                for _, rid, done in plan if done]
    todo = [(run, rid) for run, rid, done in plan if not done]
    bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc=f"sweep {sweep.name}",
               unit="run", disable=not progress)
    if executor == "local":
        for run, rid in todo:
            outcomes.append(_execute(str(sweep.notebook), run["parameters"], str(results_root), sweep.name, rid))
            bar.update(1)
            bar.set_postfix(failed=sum(o["status"] == "failed" for o in outcomes))
    elif executor == "ray":
        outcomes += _run_on_ray(sweep, todo, results_root, ray_address, bar)
    else:
        raise ValueError(f"unknown executor {executor!r}")
    bar.close()
    build_index(results_root)
    return pd.DataFrame(outcomes)


def _run_on_ray(sweep: Sweep, todo, results_root: Path, address: str | None, bar) -> list[dict]:
    """Each run a Ray task with the sweep's resource request (``ray: {num_cpus, num_gpus}``)."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the ray executor needs Ray: pip install 'kakeya_lab[ray]'") from exc
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=sweep.ray.get("num_cpus", 1), num_gpus=sweep.ray.get("num_gpus", 0))(_execute)
        pending = {
            task.remote(str(sweep.notebook), run["parameters"], str(results_root.resolve()), sweep.name, rid): rid
            for run, rid in todo
        }
        outcomes = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                outcomes.append(ray.get(ref))
                del pending[ref]
                bar.update(1)
        return outcomes
    finally:
        if started_here:
            ray.shutdown()


def _flatten_headline(metrics: dict, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """Scalars of a metrics dict, flattened to ``a.b.c`` keys (at most three levels)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool | int | float | str) or value is None:
            out[name] = value
        elif isinstance(value, dict) and depth < 2:
            out.update(_flatten_headline(value, f"{name}.", depth + 1))
    return out


def build_index(results_root: str | Path = "results") -> pd.DataFrame:
    """Scan every run folder under ``results_root`` into ``index.parquet`` (atomically):
    experiment, run id, status, parameters (``param.*``), headline metrics (``metric.*``)."""
    results_root = Path(results_root)
    rows = []
    for record in sorted(results_root.glob("*/*/run.json")):
        try:
            run = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        row = {
            "experiment": run.get("experiment"), "run_id": run.get("run_id"), "status": run.get("status"),
            "notebook": run.get("notebook"), "started": run.get("started"), "ended": run.get("ended"),
            "run_dir": str(record.parent), "error": (run.get("error") or {}).get("message"),
        }
        for key, value in (run.get("parameters") or {}).items():
            row[f"param.{key}"] = json.dumps(value) if isinstance(value, list | dict) else value
        metrics_file = record.parent / "metrics.json"
        if metrics_file.is_file():
            try:
                doc = json.loads(metrics_file.read_text())
                headline = doc.get("headline") or {}
                row.update({f"metric.{k}": v for k, v in _flatten_headline(headline).items()})
                row["model"] = (doc.get("model") or {}).get("name")
            except (OSError, json.JSONDecodeError):
                pass
        rows.append(row)
    index = pd.DataFrame(rows)
    if len(index):
        for col in index.columns:
            if index[col].dtype == object:
                index[col] = index[col].map(lambda v: v if v is None or isinstance(v, str) else json.dumps(v))
    results_root.mkdir(parents=True, exist_ok=True)
    tmp = results_root / ".index.parquet.tmp"
    index.to_parquet(tmp, index=False)
    os.replace(tmp, results_root / "index.parquet")
    return index
