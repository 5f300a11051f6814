"""Experiments: run parameterised notebooks into run folders, sweeps of them, the run index.

* :mod:`~kakeya_lab.experiments.runner` — :func:`run_notebook` (papermill into
  ``results/<experiment>/<run-id>/``);
* :mod:`~kakeya_lab.experiments.sweeps` — :class:`Sweep`, :func:`load_sweep`,
  :func:`run_sweep` (strict resume, recorded failures);
* :mod:`~kakeya_lab.experiments.ray_executor` — the same sweep on a Ray cluster (run folders
  come back to the driver packed, :mod:`~kakeya_lab.experiments.transfer`);
* :mod:`~kakeya_lab.experiments.run_record` — ``run.json`` of CLI runs (``long-run``);
* :mod:`~kakeya_lab.experiments.index` — :func:`build_index` (``results/index.parquet``,
  notebook run folders ``<root>/<experiment>/<run-id>/`` and CLI ones ``<root>/<name>/``).
"""

from kakeya_lab.experiments.index import build_index
from kakeya_lab.experiments.runner import (
    RESERVED_PARAMETERS,
    RunFailed,
    notebook_parameters,
    notebook_sha256,
    params_digest,
    run_notebook,
)
from kakeya_lab.experiments.sweeps import Sweep, load_sweep, run_id_for, run_sweep
from kakeya_lab.resume import ResumeMismatch

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
