"""Run one parameterised notebook into a run folder (papermill).

A run folder ``results/<experiment>/<run-id>/`` holds the executed notebook
(``notebook.ipynb``), the notebook's own metrics JSON and figures, and ``run.json``
(:class:`~kakeya_lab.experiments.run_record.RunRecord`: what was run, with which
parameters, how it ended). The notebook receives ``run_dir``,
``run_id`` and ``experiment`` as parameters besides the user's. ``run.json`` also records the sha256 of the notebook that ran, so a
sweep can tell a completed run of *this* notebook from one of an edited notebook.
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from pathlib import Path
from typing import Any

from kakeya_lab.experiments.run_record import RunRecord
from kakeya_lab.results import mark_results_root

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


def notebook_sha256(notebook: str | Path) -> str:
    """sha256 of the notebook file's bytes."""
    return hashlib.sha256(Path(notebook).read_bytes()).hexdigest()


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
    kernel_name: str | None = None,
) -> Path:
    """Execute ``notebook`` with ``parameters`` into a new run folder; return its path.

    Unknown parameter names are an error (a typo must not silently run the defaults).
    ``kernel_name=None`` runs the kernel the notebook names (the project's ``kakeya_lab``
    kernel, registered by ``make install``).
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
    mark_results_root(results_root)
    run_dir = Path(results_root) / experiment / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    record = RunRecord(
        run_dir,
        experiment=experiment,
        parameters=parameters,
        notebook=str(notebook),
        notebook_sha256=notebook_sha256(notebook),
        run_id=run_id,
    )
    record.start(resume=False)
    injected = {
        **parameters,
        "run_dir": str(run_dir.resolve()),
        "run_id": run_id,
        "experiment": experiment,
    }
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
        record.finish(
            "failed",
            str(exc)[-4000:],
            type(exc).__name__,
            traceback=traceback.format_exc()[-8000:],
        )
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise RunFailed(
            f"{notebook.name} failed: {type(exc).__name__}: {str(exc)[-500:]}", run_dir
        ) from exc
    record.finish("completed")
    return run_dir
