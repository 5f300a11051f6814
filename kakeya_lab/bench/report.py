"""Tables behind the report and result notebooks, computed from result files (read only).

* :func:`read_index` — the run index ``results/index.parquet`` as it is (never rebuilt
  here: sweeps and ``kakeya-lab run`` write it);
* :func:`long_run_latency_p50` — append-latency p50 per bucket of turns for every long
  run with a ``turns.csv``;
* :func:`speculative_arms` — one row per arm of every speculative run's ``metrics.json``;
* :func:`perplexity_table` — perplexity past the window and over the first window for
  per-token NLL curves (notebook ``10_sink_window_cache``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

from kakeya_lab.bench.aggregate import bucket_of

LONG_RUN_EXPERIMENTS = ("quickstart", "long_run")


def read_index(results_root: str | Path) -> pd.DataFrame:
    """The run index under ``results_root``; an empty frame when there is none yet."""
    path = Path(results_root) / "index.parquet"
    if not path.is_file():
        return pd.DataFrame(columns=["experiment", "run_id", "status", "run_dir"])
    return pd.read_parquet(path)


def completed(index: pd.DataFrame, experiments: tuple[str, ...]) -> pd.DataFrame:
    """Completed runs of ``experiments``."""
    if index.empty:
        return index
    return index[(index["status"] == "completed") & index["experiment"].isin(experiments)]


def run_folder(run, results_root: str | Path) -> Path:
    """The folder of an index row: ``<results_root>/<experiment>/<run_id>`` (the index's
    ``run_dir`` is relative to wherever the index was built)."""
    folder = Path(results_root) / str(run.experiment) / str(run.run_id)
    return folder if folder.is_dir() else Path(run.run_dir)


def long_run_latency_p50(
    index: pd.DataFrame, results_root: str | Path, buckets: int = 10
) -> pd.DataFrame:
    """Rows ``run, experiment, arm, turn, append_p50_s, kv_live_bytes`` per bucket of turns
    (about ``buckets`` buckets per run) for every completed long run with a ``turns.csv``."""
    rows = []
    for run in completed(index, LONG_RUN_EXPERIMENTS).itertuples():
        turns_csv = run_folder(run, results_root) / "turns.csv"
        if not turns_csv.is_file():
            continue
        turns = pd.read_csv(turns_csv)
        size = max(2, int(turns["turn"].max() + 1) // buckets)
        for arm, df in turns.groupby("arm", sort=False):
            grouped = df.groupby(bucket_of(df, "turns", size))
            p50 = grouped["append_latency_s"].median()
            kv = grouped["kv_live_bytes"].mean()
            for bucket, value in p50.items():
                rows.append(
                    {
                        "run": f"{run.experiment}/{run.run_id}",
                        "experiment": run.experiment,
                        "arm": arm,
                        "turn": int(bucket) * size,
                        "append_p50_s": float(value),
                        "kv_live_bytes": float(kv[bucket]),
                    }
                )
    return pd.DataFrame(
        rows, columns=["run", "experiment", "arm", "turn", "append_p50_s", "kv_live_bytes"]
    )


def speculative_arms(index: pd.DataFrame, results_root: str | Path) -> pd.DataFrame:
    """One row per arm of every completed speculative run (from its ``metrics.json``)."""
    rows = []
    for run in completed(index, ("speculative",)).itertuples():
        doc = json.loads((run_folder(run, results_root) / "metrics.json").read_text())
        for arm in doc["metrics"]["arms"]:
            rows.append(
                {
                    "run": run.run_id,
                    "model": (doc.get("model") or {}).get("name"),
                    "arm": arm["arm"],
                    "tau": arm.get("tau"),
                    "speedup": arm.get("speedup"),
                    "expected_speedup": arm.get("expected_speedup"),
                    "acceptance_rate": arm.get("acceptance_rate"),
                }
            )
    return pd.DataFrame(
        rows,
        columns=["run", "model", "arm", "tau", "speedup", "expected_speedup", "acceptance_rate"],
    )


def perplexity_table(curves: Mapping[str, np.ndarray], budget_tokens: int) -> pd.DataFrame:
    """Perplexity of each NLL curve past the first ``budget_tokens`` positions (once the cache
    is full) and over them, rounded to 2 decimals; one row per curve."""
    past = slice(budget_tokens, None)
    table = pd.DataFrame(
        {
            name: {
                "ppl (past the window)": float(np.exp(np.asarray(nll)[past].mean())),
                "ppl (first window)": float(np.exp(np.asarray(nll)[:budget_tokens].mean())),
            }
            for name, nll in curves.items()
        }
    ).T
    return table.round(2)
