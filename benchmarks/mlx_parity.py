"""Compare two run folders of the same notebook, one per backend (torch vs MLX).

    python benchmarks/mlx_parity.py results/quickstart_torch/RUN results/quickstart_mlx/RUN \
        --out evidence/mlx_quickstart/parity.json

Reads each folder's ``turns.csv`` and ``metrics.json``. Writes, per column that both tables
have among the deterministic ones (lengths, KV bytes, token counts, replies, speculative
counts), whether it is equal row for row; and per timing column the two medians and their
ratio MLX / torch (one run each, on whatever else the machine was doing: a ratio of this
run, not a property of the backends).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from kakeya_lab.durable import write_json_atomic

SAME = (
    "arm",
    "turn",
    "user_tokens",
    "history_len",
    "cache_len",
    "kv_live_bytes",
    "generated_tokens",
    "dropped_total",
    "reply",
    "proposed",
    "accepted",
    "tau",
    "stop_reason",
)
TIMINGS = ("append_latency_s", "generate_s", "decode_s_per_token", "tokens_per_s", "turn_s")


def compare(torch_dir: Path, mlx_dir: Path) -> dict:
    """The parity record of two run folders (see the module docstring)."""
    a = pd.read_csv(torch_dir / "turns.csv")
    b = pd.read_csv(mlx_dir / "turns.csv")
    if len(a) != len(b):
        return {"rows": {"torch": len(a), "mlx": len(b)}, "equal": False}
    equal = {}
    for col in SAME:
        if col in a and col in b:
            x, y = a[col].fillna("<none>").tolist(), b[col].fillna("<none>").tolist()
            equal[col] = x == y
    groups = "arm" if "arm" in a else None
    timings: dict = {}
    for col in TIMINGS:
        if col not in a or col not in b:
            continue
        for key, ga in a.groupby(groups) if groups else [("all", a)]:
            gb = b[b[groups] == key] if groups else b
            ta, tb = float(ga[col].median()), float(gb[col].median())
            timings.setdefault(str(key), {})[col] = {
                "torch_p50": ta,
                "mlx_p50": tb,
                "mlx_over_torch": tb / ta if ta else None,
            }
    metrics = {}
    for name, d in (("torch", torch_dir), ("mlx", mlx_dir)):
        doc = json.loads((d / "metrics.json").read_text())
        metrics[name] = {"backend": doc.get("backend"), "headline": doc.get("headline")}
    return {
        "rows": len(a),
        "columns_equal": equal,
        "all_equal": all(equal.values()),
        "headline_equal": metrics["torch"]["headline"] == metrics["mlx"]["headline"],
        "recorded_backend": {k: v["backend"] for k, v in metrics.items()},
        "timings": timings,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("torch_run", type=Path)
    parser.add_argument("mlx_run", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    record = compare(args.torch_run, args.mlx_run)
    print(json.dumps({k: v for k, v in record.items() if k != "timings"}, indent=1))
    for arm, cols in record.get("timings", {}).items():
        for col, t in cols.items():
            print(
                f"{arm:14s} {col:20s} torch p50 {t['torch_p50']:.4f}  mlx p50 {t['mlx_p50']:.4f}  "
                f"mlx/torch {t['mlx_over_torch']:.2f}x"
            )
    if args.out is not None:
        write_json_atomic(args.out, record)
        print(f"wrote {args.out}")
    return 0 if record.get("all_equal") else 1


if __name__ == "__main__":
    sys.exit(main())
