"""Recompute ``prefill_flat_vs_history`` for every arm of a long run's ``turns.csv``.

The verdict is computed when a run ends, under the definition of that day (runs recorded
before the reference gate took the name ``prefill_bounded`` report this test under that
name). This script applies the current one (docs/design.md, "Metrics": the partial slope of append latency
against history with the new message's length as a covariate, and length-adjusted bucket
p50s) to a recorded table, by turn buckets and by time buckets, and prints / writes one
JSON object ``{arm: {"by_turns": ..., "by_time": ...}}``:

    python benchmarks/prefill_verdicts.py evidence/mlx_long_run/turns.csv \
        --budget-tokens 1024 --turns-per-bucket 50 --seconds-per-bucket 300 --out FILE

``--unbounded-arm NAME`` (repeatable) marks arms whose cache never evicts (``full_cache``,
``reprefill``): their verdict is measured from the first turn. Turns with an error are left
out, as in the run's own aggregation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from kakeya_lab.bench.aggregate import prefill_flat_vs_history


def verdicts(
    turns: pd.DataFrame,
    *,
    budget_tokens: int,
    turns_per_bucket: int,
    seconds_per_bucket: float,
    unbounded_arms: set[str],
) -> dict[str, dict]:
    """``{arm: {"by_turns": prefill_flat_vs_history(...), "by_time": ...}}``."""
    if "error" in turns:
        turns = turns[turns["error"].isna()]
    out = {}
    for arm, rows in turns.groupby("arm", sort=False):
        budget = None if arm in unbounded_arms else budget_tokens
        out[str(arm)] = {
            "by_turns": prefill_flat_vs_history(rows, budget_tokens=budget, size=turns_per_bucket),
            "by_time": prefill_flat_vs_history(
                rows, budget_tokens=budget, by="time", size=seconds_per_bucket
            ),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("turns_csv", type=Path)
    parser.add_argument("--budget-tokens", type=int, required=True, help="sink + window")
    parser.add_argument("--turns-per-bucket", type=int, default=50)
    parser.add_argument("--seconds-per-bucket", type=float, default=600.0)
    parser.add_argument("--unbounded-arm", action="append", default=[])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    result = verdicts(
        pd.read_csv(args.turns_csv),
        budget_tokens=args.budget_tokens,
        turns_per_bucket=args.turns_per_bucket,
        seconds_per_bucket=args.seconds_per_bucket,
        unbounded_arms=set(args.unbounded_arm),
    )
    text = json.dumps(result, indent=1, default=float) + "\n"
    if args.out:
        args.out.write_text(text)
    for arm, both in result.items():
        for by, v in both.items():
            lo, hi = v["slope_ci95"] or (float("nan"), float("nan"))
            slope = v["slope_s_per_token"] if v["slope_s_per_token"] is not None else float("nan")
            print(
                f"{arm:16s} {by:9s} bounded={v['bounded']!s:5s} slope {slope * 1e6:9.3f} us/token "
                f"[{lo * 1e6:.3f}, {hi * 1e6:.3f}] covariate={v['covariate']}  {v['reason']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
