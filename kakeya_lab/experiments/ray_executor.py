"""The Ray executor of a sweep: each run a Ray task with the sweep's CPU/GPU request, on a
cluster started here (``ray.init()``) or joined by address (``--ray-address``).

A run executes on whichever node Ray picks, into that node's own disk area
(``<area>/kakeya_ray/<node-id>/``; ``area`` is the sweep's ``ray: {worker_area: PATH}``,
default the node's temp dir). The notebook travels to the node as bytes (a node with the same file at the same
path runs that one, so the notebook's relative paths work), and the finished
run folder comes back the same way, through Ray's object store, packed
(:func:`~kakeya_lab.experiments.transfer.pack_run_folder`); the driver unpacks it into its
own results root, so its index lists every run wherever it ran. The node's copy is removed
once packed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from kakeya_lab.experiments.sweep_runs import Sweep, execute_run
from kakeya_lab.experiments.transfer import pack_run_folder, unpack_run_folder


def run_on_node(
    notebook_path: str,
    notebook_bytes: bytes,
    parameters: dict,
    experiment: str,
    run_id: str,
    area: str | None = None,
) -> dict:
    """One sweep run on this node (a Ray task body): run the notebook where the driver has
    it if this node has the same file there (same checkout: relative paths work), else a
    copy written into the node's area; write the run folder into the node's area; return the outcome with the packed run folder (``archive``), the
    ``node_id`` and the ``node_run_dir`` it was written to."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node_area = Path(area or tempfile.gettempdir()) / "kakeya_ray" / node_id
    notebook = Path(notebook_path)
    if not (notebook.is_file() and notebook.read_bytes() == notebook_bytes):
        # not on this node's disk (another machine): run the shipped copy
        notebook = node_area / "notebooks" / notebook.name
        notebook.parent.mkdir(parents=True, exist_ok=True)
        notebook.write_bytes(notebook_bytes)
    results_root = node_area / "results"
    shutil.rmtree(results_root / experiment / run_id, ignore_errors=True)  # a stale attempt
    outcome = execute_run(str(notebook), parameters, str(results_root), experiment, run_id)
    node_run_dir = Path(outcome["run_dir"])
    outcome["archive"] = pack_run_folder(node_run_dir)
    outcome["node_id"] = node_id
    outcome["node_run_dir"] = str(node_run_dir)
    shutil.rmtree(node_run_dir, ignore_errors=True)
    return outcome


def run_on_ray(sweep: Sweep, todo, results_root: Path, address: str | None, bar) -> list[dict]:
    """Each run a Ray task with the sweep's resource request (``ray: {num_cpus, num_gpus,
    worker_area}``); every run folder is unpacked into ``results_root`` as it comes back."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the ray executor needs Ray: pip install 'kakeya_lab[ray]'") from exc
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(
            num_cpus=sweep.ray.get("num_cpus", 1), num_gpus=sweep.ray.get("num_gpus", 0)
        )(run_on_node)
        notebook_bytes = ray.put(sweep.notebook.read_bytes())
        pending = {
            task.remote(
                str(sweep.notebook),
                notebook_bytes,
                run["parameters"],
                sweep.name,
                rid,
                sweep.ray.get("worker_area"),
            ): rid
            for run, rid in todo
        }
        outcomes = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                outcome = ray.get(ref)
                archive = outcome.pop("archive")
                outcome["run_dir"] = str(
                    unpack_run_folder(
                        archive,
                        results_root,
                        sweep.name,
                        outcome["run_id"],
                        notebook=str(sweep.notebook),
                    )
                )
                outcomes.append(outcome)
                del pending[ref]
                bar.update(1)
        return outcomes
    finally:
        if started_here:
            ray.shutdown()
