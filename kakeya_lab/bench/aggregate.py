"""Aggregates of a long run (DESIGN.md "Metrics"), computed from the per-turn table.

Every function takes the rows of one arm (columns of
:class:`~kakeya_lab.bench.long_run.TurnRecord`) and returns a plain dict that says what it
concluded and why. Degenerate input never passes: no turns, a cache that never filled, or
a zero ``kv_live_bytes`` series are "not bounded", with the reason.

Buckets: by ``turns_per_bucket`` turns (``turn // 50``) and by ``seconds_per_bucket`` of
wall time (``wall_s // 600``); both are reported.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

TURNS_PER_BUCKET = 50
SECONDS_PER_BUCKET = 600.0


def bucket_of(df: pd.DataFrame, by: str = "turns", size: float | None = None) -> pd.Series:
    """Bucket index of every row: ``turn // size`` or ``wall_s // size``."""
    if by == "turns":
        return (df["turn"] // int(size or TURNS_PER_BUCKET)).astype(int)
    if by == "time":
        return (df["wall_s"] // float(size or SECONDS_PER_BUCKET)).astype(int)
    raise ValueError(f"bucket by 'turns' or 'time', got {by!r}")


def first_full_turn(df: pd.DataFrame, budget_tokens: int | None) -> int | None:
    """The first turn after which the cache held ``budget_tokens`` entries (None: never)."""
    if budget_tokens is None or df.empty:
        return None
    full = df[df["cache_len"] >= budget_tokens]
    return int(full["turn"].iloc[0]) if len(full) else None


def kv_bounded(
    df: pd.DataFrame,
    *,
    budget_tokens: int | None,
    budget_bytes: int | None,
    by: str = "turns",
    size: float | None = None,
    tolerance: float = 0.01,
) -> dict:
    """After the cache first fills, every bucket's mean ``kv_live_bytes`` is within
    ``tolerance`` of the first full bucket's and no turn is above ``budget_bytes``."""
    out = {"bounded": False, "reason": None, "bucket_means": [], "first_full_turn": None}
    if df.empty:
        out["reason"] = "no turns"
        return out
    if (df["kv_live_bytes"] <= 0).any():
        out["reason"] = "kv_live_bytes is zero on some turn (a bug, not a result)"
        return out
    if budget_tokens is None or budget_bytes is None:
        out["reason"] = "no budget: this cache never evicts"
        return out
    start = first_full_turn(df, budget_tokens)
    out["first_full_turn"] = start
    if start is None:
        out["reason"] = "the cache never filled"
        return out
    full = df[df["turn"] >= start]
    means = full.groupby(bucket_of(full, by, size))["kv_live_bytes"].mean()
    out["bucket_means"] = [float(m) for m in means]
    if len(means) < 2:
        out["reason"] = "fewer than two buckets after the cache filled"
        return out
    ref = means.iloc[0]
    worst = float((means / ref - 1).abs().max())
    out["max_relative_deviation"] = worst
    out["max_kv_live_bytes"] = int(full["kv_live_bytes"].max())
    if int(full["kv_live_bytes"].max()) > budget_bytes:
        out["reason"] = "above the analytic budget"
    elif worst > tolerance:
        out["reason"] = f"a bucket deviates {worst:.1%} from the first full bucket"
    else:
        out["bounded"] = True
        out["reason"] = "flat within tolerance and under budget"
    return out


def _slope_ci(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """OLS slope and its 95% interval (t distribution)."""
    from scipy import stats

    res = stats.linregress(x, y)
    t = stats.t.ppf(0.975, len(x) - 2)
    return float(res.slope), float(res.slope - t * res.stderr), float(res.slope + t * res.stderr)


def latency_drift_p50(
    df: pd.DataFrame, column: str = "append_latency_s", *, by: str = "turns", size: float | None = None,
    start_turn: int | None = None,
) -> dict:
    """Last bucket p50 minus first bucket p50 of ``column`` (seconds and percent)."""
    rows = df if start_turn is None else df[df["turn"] >= start_turn]
    if len(rows) == 0:
        return {"first_p50_s": None, "last_p50_s": None, "drift_s": None, "drift_pct": None, "buckets": 0}
    p50 = rows.groupby(bucket_of(rows, by, size))[column].median()
    first, last = float(p50.iloc[0]), float(p50.iloc[-1])
    return {
        "first_p50_s": first,
        "last_p50_s": last,
        "drift_s": last - first,
        "drift_pct": 100.0 * (last - first) / first if first > 0 else None,
        "buckets": int(len(p50)),
    }


def prefill_bounded(
    df: pd.DataFrame, *, budget_tokens: int | None, by: str = "turns", size: float | None = None,
    tolerance: float = 0.10,
) -> dict:
    """The slope of append latency against history length is indistinguishable from zero
    (its 95% interval contains 0) and the last bucket's p50 is within ``tolerance`` of
    the first full bucket's. Measured after the cache first filled (from the first turn
    for a cache that never evicts, which then must show a slope to fail)."""
    out = {"bounded": False, "reason": None, "slope_s_per_token": None, "slope_ci95": None}
    if df.empty:
        out["reason"] = "no turns"
        return out
    start = first_full_turn(df, budget_tokens) if budget_tokens is not None else int(df["turn"].iloc[0])
    if start is None:
        out["reason"] = "the cache never filled"
        return out
    rows = df[df["turn"] >= start]
    if len(rows) < 3:
        out["reason"] = "fewer than three turns to fit a slope"
        return out
    slope, lo, hi = _slope_ci(rows["history_len"].to_numpy(float), rows["append_latency_s"].to_numpy(float))
    drift = latency_drift_p50(rows, "append_latency_s", by=by, size=size)
    out.update(slope_s_per_token=slope, slope_ci95=[lo, hi], drift=drift)
    flat_slope = lo <= 0.0 <= hi
    within = drift["drift_pct"] is not None and abs(drift["drift_pct"]) <= 100 * tolerance
    if drift["buckets"] < 2:
        out["reason"] = "fewer than two buckets after the cache filled"
    elif not flat_slope:
        out["reason"] = f"append latency grows with history ({slope * 1e6:.3f} us/token, 95% CI [{lo * 1e6:.3f}, {hi * 1e6:.3f}])" if slope > 0 else "append latency slope differs from zero"
    elif not within:
        out["reason"] = f"last bucket p50 differs {drift['drift_pct']:.1f}% from the first"
    else:
        out["bounded"] = True
        out["reason"] = "slope indistinguishable from zero and p50 within tolerance"
    return out


def rss_drift(df: pd.DataFrame, *, start_turn: int | None = None, by: str = "turns", size: float | None = None) -> dict:
    """Process RSS: last bucket mean vs first bucket mean (after ``start_turn``)."""
    rows = df if start_turn is None else df[df["turn"] >= start_turn]
    if rows.empty or "rss_bytes" not in rows:
        return {"first_bytes": None, "last_bytes": None, "drift_pct": None}
    means = rows.groupby(bucket_of(rows, by, size))["rss_bytes"].mean()
    first, last = float(means.iloc[0]), float(means.iloc[-1])
    return {"first_bytes": first, "last_bytes": last, "drift_pct": 100.0 * (last - first) / first if first else None}


def repetition_rate(token_ids: list[int], n: int = 4) -> float:
    """Share of repeated n-grams in one reply: ``1 - distinct / total`` (0 if too short)."""
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


def aggregate_arm(
    df: pd.DataFrame, *, budget_tokens: int | None, budget_bytes: int | None,
    turns_per_bucket: int = TURNS_PER_BUCKET, seconds_per_bucket: float = SECONDS_PER_BUCKET,
) -> dict:
    """Every aggregate of one arm, by turns and by time."""
    ok = df[df["error"].isna()] if "error" in df else df
    out: dict = {"turns": int(len(df)), "errors": int(len(df) - len(ok))}
    if ok.empty:
        out["kv_bounded"] = False
        out["reason"] = "no successful turns"
        return out
    start = first_full_turn(ok, budget_tokens)
    for by, size in (("turns", turns_per_bucket), ("time", seconds_per_bucket)):
        out[f"kv_bounded_by_{by}"] = kv_bounded(
            ok, budget_tokens=budget_tokens, budget_bytes=budget_bytes, by=by, size=size)
        out[f"prefill_bounded_by_{by}"] = prefill_bounded(ok, budget_tokens=budget_tokens, by=by, size=size)
        out[f"latency_drift_p50_by_{by}"] = {
            col: latency_drift_p50(ok, col, by=by, size=size, start_turn=start)
            for col in ("append_latency_s", "first_token_s", "decode_s_per_token")
            if col in ok
        }
    out["kv_bounded"] = out["kv_bounded_by_turns"]["bounded"]
    out["prefill_bounded"] = out["prefill_bounded_by_turns"]["bounded"]
    out["rss_drift"] = rss_drift(ok, start_turn=start, size=turns_per_bucket)
    out["eos_rate"] = float((ok["stop_reason"] == "eos").mean())
    if "repetition" in ok:
        out["repetition_rate"] = float(ok["repetition"].mean())
    out["first_full_turn"] = start
    buckets = bucket_of(ok, "turns", turns_per_bucket)
    last_bucket, first_bucket = ok[buckets == buckets.max()], ok[buckets == buckets.min()]
    ratio = last_bucket["append_latency_s"].median() / first_bucket["append_latency_s"].median()
    out["append_latency_last_over_first_bucket"] = float(ratio) if math.isfinite(ratio) else None
    return out
