"""Self-describing result files (DESIGN.md "Results"), written atomically."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
_PACKAGES = ("kakeya_lab", "torch", "transformers", "numpy", "pandas", "plotly", "papermill")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_commit(path: str | Path = ".") -> str | None:
    """The commit of the checkout holding ``path`` (``-dirty`` if it has changes)."""
    try:
        root = Path(path).resolve()
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict[str, Any]:
    """CPU (and GPU, when torch sees one) of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        info["gpu"] = None
    return info


def run_header(
    *,
    experiment: str,
    run_id: str,
    model: Any = None,
    backend: str = "torch",
    dtype: str = "float32",
    cache: dict | None = None,
    proposer: dict | None = None,
    seed: int | None = None,
    started: str | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    """The header every result file starts with. ``model`` is a ModelDescription (or dict)."""
    if model is not None and not isinstance(model, dict):
        model = {
            "name": model.name,
            "weight_sha256": model.weight_sha256,
            "architecture": model.architecture,
            "random": model.random,
        }
    cache = cache or {}
    header = {
        "schema_version": SCHEMA_VERSION,
        "experiment": experiment,
        "run_id": run_id,
        "model": model,
        "backend": backend,
        "dtype": dtype,
        "sink": cache.get("sink"),
        "window": cache.get("window"),
        "positions": cache.get("positions"),
        "proposer": proposer,
        "seed": seed,
        "git_commit": git_commit(Path(__file__).parent),
        "packages": package_versions(),
        "hardware": hardware(),
        "started": started or now_iso(),
        "ended": None,
    }
    if extra:
        header.update(extra)
    return header


def _finite(obj: Any) -> Any:
    """NaN and infinities become None (JSON has no such numbers; pandas makes them for gaps)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return _finite(obj.item())
    return obj


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write JSON via a temp file in the same folder and rename it into place
    (non-finite floats are written as null)."""
    obj = _finite(obj)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=2, default=_jsonable, allow_nan=False)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def write_metrics(
    run_dir: str | Path, header: dict, metrics: dict, *, headline: dict | None = None,
    name: str = "metrics.json",
) -> Path:
    """Write ``{**header, "ended": now, "headline": ..., "metrics": metrics}`` atomically.

    ``headline``: the few numbers the run index (``results/index.parquet``) shows.
    """
    doc = dict(header)
    doc["ended"] = now_iso()
    doc["headline"] = headline or {}
    doc["metrics"] = metrics
    return write_json_atomic(Path(run_dir) / name, doc)


def save_figure(fig: Any, run_dir: str | Path, name: str) -> Path:
    """Save a plotly figure as standalone-offline HTML (plotly.js written once per folder)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{name}.html"
    tmp = run_dir / f".{name}.html.tmp"
    fig.write_html(tmp, include_plotlyjs="directory", full_html=True)
    os.replace(tmp, path)
    return path
