"""Tables behind the report and result notebooks, computed from result files (read only).

* :func:`read_index` — the run index ``results/index.parquet`` as it is (never rebuilt
  here: sweeps and ``kakeya-lab run`` write it);
* :func:`long_run_latency_p50` — append-latency p50 per bucket of turns for every long
  run with a ``turns.csv``, completed or partial (stopped by a signal, an error budget or a
  time limit), in-process and served arms alike, each row marked with its run's status and
  whether its arm went through a server;
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
# A run's results are readable once it has ended, completed or not: a partial run (a signal,
# an error budget, a time limit) wrote a valid report of the turns it ran.
REPORTED_STATUSES = ("completed", "partial")
TURN_TABLES = ("turns.csv", "served_turns.csv")


def read_index(results_root: str | Path) -> pd.DataFrame:
    """The run index under ``results_root``; an empty frame when there is none yet."""
    path = Path(results_root) / "index.parquet"
    if not path.is_file():
        return pd.DataFrame(columns=["experiment", "run_id", "status", "run_dir"])
    return pd.read_parquet(path)


def completed(
    index: pd.DataFrame,
    experiments: tuple[str, ...],
    statuses: tuple[str, ...] = ("completed",),
) -> pd.DataFrame:
    """Runs of ``experiments`` whose status is one of ``statuses`` (default: completed)."""
    if index.empty:
        return index
    return index[index["status"].isin(statuses) & index["experiment"].isin(experiments)]


def run_folder(run, results_root: str | Path) -> Path:
    """The folder of an index row: ``<results_root>/<experiment>/<run_id>`` (the index's
    ``run_dir`` is relative to wherever the index was built)."""
    folder = Path(results_root) / str(run.experiment) / str(run.run_id)
    return folder if folder.is_dir() else Path(run.run_dir)


def long_run_latency_p50(
    index: pd.DataFrame, results_root: str | Path, buckets: int = 10
) -> pd.DataFrame:
    """Rows ``run, experiment, status, arm, served, label, turn, append_p50_s,
    kv_live_bytes`` per bucket of turns (about ``buckets`` buckets per run) for every
    completed or partial long run with a ``turns.csv`` or ``served_turns.csv``
    (:data:`REPORTED_STATUSES`).

    ``served``: the arm went through a server (``grpc_session``, ``http_reuse``,
    ``http_stateless``); ``label`` names the run and arm for a legend, with ``(partial)``
    and ``served`` spelled out so a partial or served curve is never read as another kind.
    Turns that failed (a non-empty ``error``) are left out of the p50s."""
    from kakeya_lab.bench.long_run.settings import SERVED_ARMS

    rows = []
    for run in completed(index, LONG_RUN_EXPERIMENTS, REPORTED_STATUSES).itertuples():
        folder = run_folder(run, results_root)
        # in-process arms in turns.csv, served arms in served_turns.csv (a run may have both)
        tables = [pd.read_csv(folder / n) for n in TURN_TABLES if (folder / n).is_file()]
        if not tables:
            continue
        turns = pd.concat(tables, ignore_index=True)
        if "error" in turns:
            turns = turns[turns["error"].isna()]
        if turns.empty:
            continue
        size = max(2, int(turns["turn"].max() + 1) // buckets)
        name = f"{run.experiment}/{run.run_id}"
        for arm, df in turns.groupby("arm", sort=False):
            served = str(arm) in SERVED_ARMS
            label = f"{name}{' (partial)' if run.status == 'partial' else ''} {'served ' if served else ''}{arm}"
            grouped = df.groupby(bucket_of(df, "turns", size))
            p50 = grouped["append_latency_s"].median()
            kv = grouped["kv_live_bytes"].mean()
            for bucket, value in p50.items():
                rows.append(
                    {
                        "run": name,
                        "experiment": run.experiment,
                        "status": run.status,
                        "arm": arm,
                        "served": served,
                        "label": label,
                        "turn": int(bucket) * size,
                        "append_p50_s": float(value),
                        "kv_live_bytes": float(kv[bucket]),
                    }
                )
    return pd.DataFrame(
        rows,
        columns=[
            "run", "experiment", "status", "arm", "served", "label", "turn", "append_p50_s",
            "kv_live_bytes",
        ],
    )  # fmt: skip


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
