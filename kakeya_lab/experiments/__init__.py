"""Experiments: run parameterised notebooks into run folders, sweeps of them, the run index.

* :mod:`~kakeya_lab.experiments.runner` — :func:`run_notebook` (papermill into
  ``results/<experiment>/<run-id>/``);
* :mod:`~kakeya_lab.experiments.sweep_runs` — :class:`Sweep`, :func:`load_sweep`, one run
  of a sweep (:func:`execute_run`);
* :mod:`~kakeya_lab.experiments.sweeps` — :func:`run_sweep` (strict resume, recorded
  failures, local or Ray);
* :mod:`~kakeya_lab.experiments.ray_executor` — the same sweep on a Ray cluster (run folders
  come back to the driver packed, :mod:`~kakeya_lab.experiments.transfer`);
* :mod:`~kakeya_lab.experiments.run_record` — ``run.json`` of every run folder (notebook or CLI);
* :mod:`~kakeya_lab.experiments.long_run` — a long run's folder: ``run.json``, reports, index;
* :mod:`~kakeya_lab.experiments.index` — :func:`build_index` (``results/index.parquet``,
  notebook run folders ``<root>/<experiment>/<run-id>/`` and CLI ones ``<root>/<name>/``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kakeya_lab.experiments.index import build_index
    from kakeya_lab.experiments.runner import (
        RESERVED_PARAMETERS,
        RunFailed,
        notebook_parameters,
        notebook_sha256,
        params_digest,
        run_notebook,
    )
    from kakeya_lab.experiments.sweep_runs import Sweep, load_sweep, run_id_for
    from kakeya_lab.experiments.sweeps import run_sweep
    from kakeya_lab.resume import ResumeMismatch

# Imported on first use (PEP 562): the ``run``/``sweep`` commands' ``--help`` need no pandas.
_LAZY = {
    "build_index": "kakeya_lab.experiments.index",
    "RESERVED_PARAMETERS": "kakeya_lab.experiments.runner",
    "RunFailed": "kakeya_lab.experiments.runner",
    "notebook_parameters": "kakeya_lab.experiments.runner",
    "notebook_sha256": "kakeya_lab.experiments.runner",
    "params_digest": "kakeya_lab.experiments.runner",
    "run_notebook": "kakeya_lab.experiments.runner",
    "Sweep": "kakeya_lab.experiments.sweep_runs",
    "load_sweep": "kakeya_lab.experiments.sweep_runs",
    "run_id_for": "kakeya_lab.experiments.sweep_runs",
    "run_sweep": "kakeya_lab.experiments.sweeps",
    "ResumeMismatch": "kakeya_lab.resume",
}

__all__ = [
    "RESERVED_PARAMETERS",
    "ResumeMismatch",
    "RunFailed",
    "Sweep",
    "build_index",
    "load_sweep",
    "notebook_parameters",
    "notebook_sha256",
    "params_digest",
    "run_id_for",
    "run_notebook",
    "run_sweep",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
