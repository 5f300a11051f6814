"""Run folders as bytes: a run made on one machine packed into a tar.gz and unpacked into
another machine's results tree (how a Ray sweep brings its runs back to the driver)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from kakeya_lab.durable import write_json_atomic
from kakeya_lab.results import PLOTLY_JS, mark_results_root


def pack_run_folder(run_dir: str | Path) -> bytes:
    """The files of ``run_dir`` (relative names, no links) as tar.gz bytes."""
    run_dir = Path(run_dir)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(run_dir.rglob("*")):
            if path.is_file() and not path.is_symlink():
                tar.add(path, arcname=str(path.relative_to(run_dir)), recursive=False)
    return buffer.getvalue()


def unpack_run_folder(
    data: bytes,
    results_root: str | Path,
    experiment: str,
    run_id: str,
    *,
    notebook: str | None = None,
) -> Path:
    """Put a packed run folder at ``<results_root>/<experiment>/<run_id>`` (replacing what
    was there only once the whole archive is read); ``notebook``: the path ``run.json``
    names (the driver's copy, not the worker's). Returns the folder."""
    root = mark_results_root(results_root)
    target = root / experiment / run_id
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{run_id}-", dir=target.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(staging, filter="data")  # no absolute paths, links or escapes
        record = staging / "run.json"
        if notebook is not None and record.is_file():
            doc = json.loads(record.read_text())
            doc["notebook"] = notebook
            write_json_atomic(record, doc)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if any(target.glob("*.html")) and not (root / PLOTLY_JS).is_file():
        from kakeya_lab.results import ensure_plotlyjs

        ensure_plotlyjs(root)  # the figures load plotly.js from the results root
    return target
