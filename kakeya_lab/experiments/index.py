"""The run index: one row per run folder under a results root, in ``index.parquet``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from kakeya_lab.durable import write_parquet_atomic

INDEX_NAME = "index.parquet"


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


def run_records(results_root: str | Path) -> list[Path]:
    """Every ``run.json`` of a results tree: notebook and sweep runs at
    ``<root>/<experiment>/<run-id>/run.json``, CLI runs (``kakeya-lab long-run
    results/NAME``) at ``<root>/<name>/run.json``."""
    root = Path(results_root)
    return sorted({*root.glob("*/run.json"), *root.glob("*/*/run.json")})


def build_index(results_root: str | Path = "results") -> pd.DataFrame:
    """Scan every run folder under ``results_root`` (:func:`run_records`) into
    ``index.parquet`` (atomically): experiment, run id, status, the command of a CLI run,
    parameters (``param.*``), headline metrics (``metric.*``)."""
    results_root = Path(results_root)
    rows = []
    for record in run_records(results_root):
        try:
            run = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        row = {
            "experiment": run.get("experiment"),
            "run_id": run.get("run_id"),
            "status": run.get("status"),
            "notebook": run.get("notebook"),
            "command": " ".join(run["command"]) if run.get("command") else None,
            "started": run.get("started"),
            "ended": run.get("ended"),
            "run_dir": str(record.parent),
            "error": (run.get("error") or {}).get("message"),
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
                index[col] = index[col].map(
                    lambda v: v if v is None or isinstance(v, str) else json.dumps(v)
                )
    write_parquet_atomic(results_root / INDEX_NAME, index)
    return index


def index_results_root(run_dir: str | Path) -> None:
    """Refresh ``index.parquet`` of the results tree holding ``run_dir`` (a folder with the
    ``.kakeya-results`` marker, or one named ``results``), so the run is listed at once;
    a run folder elsewhere changes nothing."""
    from kakeya_lab.results import RESULTS_MARKER

    parent = Path(run_dir).resolve().parent
    if (parent / RESULTS_MARKER).exists() or parent.name == "results":
        build_index(parent)
