"""The Ray executor of a sweep: each run a Ray task with the sweep's CPU/GPU request,
on a cluster started here (``ray.init()``) or joined by address."""

from __future__ import annotations

from pathlib import Path

from kakeya_lab.experiments.sweeps import Sweep, execute_run


def run_on_ray(sweep: Sweep, todo, results_root: Path, address: str | None, bar) -> list[dict]:
    """Each run a Ray task with the sweep's resource request (``ray: {num_cpus, num_gpus}``)."""
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
        )(execute_run)
        pending = {
            task.remote(
                str(sweep.notebook), run["parameters"], str(results_root.resolve()), sweep.name, rid
            ): rid
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
