"""Aggregates of a long run (``docs/design.md``, "Metrics"), computed from the per-turn table.

Every function takes the rows of one arm (columns of
:class:`~kakeya_lab.bench.long_run.TurnRecord`) and returns a plain dict that says what it
concluded and why. Degenerate input never passes: no turns, a cache that never filled, or
a zero ``kv_live_bytes`` series are "not bounded", with the reason.

Buckets: by ``turns_per_bucket`` turns (``turn // 50``) and by ``seconds_per_bucket`` of
wall time (``wall_s // 600``); both are reported. Drifts compare the first and the last
*full* bucket (:func:`full_buckets`); with fewer than two full buckets a drift is "not
measured" (``None`` with a ``reason``), never 0 — one bucket compared with itself says
nothing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kakeya_lab.bench.gates import PREFILL_TOLERANCE, check_prefill_gate

TURNS_PER_BUCKET = 50
SECONDS_PER_BUCKET = 600.0


def bucket_of(df: pd.DataFrame, by: str = "turns", size: float | None = None) -> pd.Series:
    """Bucket index of every row: ``turn // size`` or ``wall_s // size``."""
    if by == "turns":
        return (df["turn"] // int(size or TURNS_PER_BUCKET)).astype(int)
    if by == "time":
        return (df["wall_s"] // float(size or SECONDS_PER_BUCKET)).astype(int)
    raise ValueError(f"bucket by 'turns' or 'time', got {by!r}")


NOT_MEASURED = "not measured: fewer than two full buckets"


def full_buckets(df: pd.DataFrame, by: str = "turns", size: float | None = None) -> list[int]:
    """The bucket indices of ``df`` that are complete.

    By turns: a bucket holding ``size`` turns. By time: a bucket the run went past (a
    later bucket has rows) or whose rows reach 90% of its span (the run ended near its end).
    """
    if df.empty:
        return []
    buckets = bucket_of(df, by, size)
    if by == "turns":
        counts = df.groupby(buckets)["turn"].nunique()
        return [int(b) for b, n in counts.items() if n >= int(size or TURNS_PER_BUCKET)]
    width = float(size or SECONDS_PER_BUCKET)
    last = int(buckets.max())
    out = []
    for b in sorted(buckets.unique()):
        reach = float(df.loc[buckets == b, "wall_s"].max()) - b * width
        if b < last or reach >= 0.9 * width:
            out.append(int(b))
    return out


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
    out: dict[str, Any] = {
        "bounded": False,
        "reason": None,
        "bucket_means": [],
        "first_full_turn": None,
    }
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


def slope_ci(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """OLS slope and its 95% interval (t distribution)."""
    from scipy import stats

    res = stats.linregress(x, y)
    t = stats.t.ppf(0.975, len(x) - 2)
    return float(res.slope), float(res.slope - t * res.stderr), float(res.slope + t * res.stderr)


def _partial_slope_ci(
    x: np.ndarray, z: np.ndarray, y: np.ndarray
) -> tuple[float, float, float, float] | None:
    """OLS of ``y ~ 1 + x + z``: the slope on ``x`` with its 95% interval (t distribution,
    ``n - 3`` degrees of freedom), and the coefficient on ``z``; None when ``x`` and ``z``
    cannot be told apart (fewer than four rows, or ``x``, ``z`` and a constant collinear)."""
    from scipy import stats

    design = np.column_stack([np.ones_like(x), x, z])
    if len(y) < 4 or np.linalg.matrix_rank(design) < 3:
        return None
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    dof = len(y) - 3
    cov = (resid @ resid / dof) * np.linalg.inv(design.T @ design)
    half = stats.t.ppf(0.975, dof) * float(np.sqrt(cov[1, 1]))
    return float(coef[1]), float(coef[1] - half), float(coef[1] + half), float(coef[2])


def latency_drift_p50(
    df: pd.DataFrame,
    column: str = "append_latency_s",
    *,
    by: str = "turns",
    size: float | None = None,
    start_turn: int | None = None,
) -> dict:
    """Last full bucket p50 minus first full bucket p50 of ``column`` (seconds and
    percent), with the p95 of both buckets beside. Fewer than two full buckets: every
    number None and ``reason`` says "not measured"."""
    rows = df if start_turn is None else df[df["turn"] >= start_turn]
    out: dict[str, Any] = {
        "first_p50_s": None,
        "last_p50_s": None,
        "drift_s": None,
        "drift_pct": None,
        "first_p95_s": None,
        "last_p95_s": None,
        "buckets": 0,
        "full_buckets": 0,
        "reason": NOT_MEASURED,
    }
    rows = rows[rows[column].notna()] if len(rows) else rows
    if len(rows) == 0:
        return out
    buckets = bucket_of(rows, by, size)
    full = full_buckets(rows, by, size)
    out["buckets"], out["full_buckets"] = int(buckets.nunique()), len(full)
    if len(full) < 2:
        return out
    first_rows, last_rows = rows[buckets == full[0]][column], rows[buckets == full[-1]][column]
    first, last = float(first_rows.median()), float(last_rows.median())
    out.update(
        first_p50_s=first,
        last_p50_s=last,
        drift_s=last - first,
        drift_pct=100.0 * (last - first) / first if first > 0 else None,
        first_p95_s=float(first_rows.quantile(0.95)),
        last_p95_s=float(last_rows.quantile(0.95)),
        reason=f"first full bucket {full[0]} vs last full bucket {full[-1]}",
    )
    return out


def p50(values: Any) -> float | None:
    """The median of the non-missing ``values`` by numpy's linear interpolation
    (``np.percentile(values, 50, method="linear")``; None without values). Every p50 and
    p95 of this module interpolates the same way (pandas' ``quantile`` default)."""
    v = np.asarray(pd.Series(values, dtype=float).dropna(), dtype=float)
    return float(np.percentile(v, 50, method="linear")) if v.size else None


def prefill_bounded(
    df: pd.DataFrame,
    *,
    budget_tokens: int | None,
    by: str = "turns",
    size: float | None = None,
    tolerance: float = PREFILL_TOLERANCE,
    direction: str = "increase",
) -> dict:
    """The reference engine's prefill gate: the last full bucket's p50 append latency
    compared with the first full bucket's p50 (raw seconds, :func:`p50`), measured after
    the cache first filled (from the first turn for a cache that never evicts).

    ``direction="increase"`` (the reference's default): only growth beyond ``tolerance``
    (a fraction: 0.10 is 10%) fails, so a run whose prefill got faster passes;
    ``"both"``: a change beyond ``tolerance`` either way fails. Fewer than two full
    buckets: not bounded, "not measured". The stricter history-slope test is
    :func:`prefill_flat_vs_history`."""
    check_prefill_gate(tolerance, direction)
    out: dict[str, Any] = {
        "bounded": False,
        "reason": None,
        "tolerance": float(tolerance),
        "direction": direction,
        "first_p50_s": None,
        "last_p50_s": None,
        "change_pct": None,
        "first_bucket": None,
        "last_bucket": None,
    }
    if df.empty:
        out["reason"] = "no turns"
        return out
    start = (
        first_full_turn(df, budget_tokens) if budget_tokens is not None else int(df["turn"].min())
    )
    if start is None:
        out["reason"] = "the cache never filled"
        return out
    rows = df[(df["turn"] >= start) & df["append_latency_s"].notna()]
    full = full_buckets(rows, by, size)
    if len(full) < 2:
        out["reason"] = "fewer than two full buckets after the cache filled (not measured)"
        return out
    buckets = bucket_of(rows, by, size)
    first = p50(rows.loc[buckets == full[0], "append_latency_s"])
    last = p50(rows.loc[buckets == full[-1], "append_latency_s"])
    assert first is not None and last is not None  # full buckets hold rows
    change = (last - first) / first if first > 0 else math.inf
    out.update(
        first_p50_s=first,
        last_p50_s=last,
        change_pct=100.0 * change if math.isfinite(change) else None,
        first_bucket=int(full[0]),
        last_bucket=int(full[-1]),
    )
    beyond = change > tolerance if direction == "increase" else abs(change) > tolerance
    # a hair of float slack: 0.11/0.10 - 1 must read as 10%, not 10.000000000000009%
    if beyond and not math.isclose(abs(change), tolerance, rel_tol=1e-9, abs_tol=1e-12):
        out["reason"] = (
            f"last bucket p50 {last:.6g}s is {100 * change:+.1f}% from the first full "
            f"bucket's {first:.6g}s (tolerance {tolerance:.0%}, {direction})"
        )
    else:
        out["bounded"] = True
        out["reason"] = (
            f"last bucket p50 {100 * change:+.1f}% from the first full bucket's "
            f"(tolerance {tolerance:.0%}, {direction})"
        )
    return out


def prefill_flat_vs_history(
    df: pd.DataFrame,
    *,
    budget_tokens: int | None,
    by: str = "turns",
    size: float | None = None,
    tolerance: float = 0.10,
) -> dict:
    """The stricter of the two prefill gates (``docs/design.md``, "Metrics"): the slope of
    append latency against history length is indistinguishable from zero (its 95% interval
    contains 0) AND the last full bucket's p50 is within ``tolerance`` of the first full
    bucket's in *either* direction. Measured after the cache first filled (from the first turn
    for a cache that never evicts, which then must show a slope to fail).

    A turn's append latency also grows with the length of its new message
    (``user_tokens``), which real conversations vary; when that column varies, the slope
    is the partial slope of ``latency ~ 1 + history_len + user_tokens`` and the bucket
    p50s compare the length-adjusted latency ``latency - c * (user_tokens - median)``
    (``c``: the fitted seconds per message token), so shorter late messages read neither
    as a falling slope nor as drift. ``covariate`` names what was adjusted for;
    ``from_turn`` is the first turn of the fit."""
    out: dict[str, Any] = {
        "bounded": False,
        "reason": None,
        "slope_s_per_token": None,
        "slope_ci95": None,
        "covariate": None,
        "message_s_per_token": None,
        "from_turn": None,
    }
    if df.empty:
        out["reason"] = "no turns"
        return out
    start = (
        first_full_turn(df, budget_tokens) if budget_tokens is not None else int(df["turn"].iloc[0])
    )
    if start is None:
        out["reason"] = "the cache never filled"
        return out
    out["from_turn"] = int(start)  # the fit's first turn (the cache's first full one)
    rows = df[df["turn"] >= start]
    if len(rows) < 3:
        out["reason"] = "fewer than three turns to fit a slope"
        return out
    x = rows["history_len"].to_numpy(float)
    y = rows["append_latency_s"].to_numpy(float)
    z = rows["user_tokens"].to_numpy(float) if "user_tokens" in rows else None
    partial = _partial_slope_ci(x, z, y) if z is not None else None
    if partial is not None and z is not None:
        slope, lo, hi, per_message_token = partial
        adjusted = rows.assign(append_latency_s=y - per_message_token * (z - np.median(z)))
        out.update(covariate="user_tokens", message_s_per_token=per_message_token)
    else:
        slope, lo, hi = slope_ci(x, y)
        adjusted = rows
    drift = latency_drift_p50(adjusted, "append_latency_s", by=by, size=size)
    out.update(slope_s_per_token=slope, slope_ci95=[lo, hi], drift=drift)
    flat_slope = lo <= 0.0 <= hi
    within = drift["drift_pct"] is not None and abs(drift["drift_pct"]) <= 100 * tolerance
    if drift["full_buckets"] < 2:
        out["reason"] = "fewer than two full buckets after the cache filled (not measured)"
    elif not flat_slope:
        out["reason"] = (
            f"append latency grows with history ({slope * 1e6:.3f} us/token, 95% CI [{lo * 1e6:.3f}, {hi * 1e6:.3f}])"
            if slope > 0
            else "append latency slope differs from zero"
        )
    elif drift["drift_pct"] is None:
        # the length adjustment can move a fast first bucket's p50 to zero or below
        out["reason"] = (
            f"the first full bucket's p50 is {drift['first_p50_s']:.3g}s after the length "
            "adjustment: its relative drift is not defined (not measured)"
        )
    elif not within:
        out["reason"] = f"last bucket p50 differs {drift['drift_pct']:.1f}% from the first"
    else:
        out["bounded"] = True
        out["reason"] = "slope indistinguishable from zero and p50 within tolerance"
    out["tolerance"] = tolerance
    return out


def rss_drift(
    df: pd.DataFrame, *, start_turn: int | None = None, by: str = "turns", size: float | None = None
) -> dict:
    """Process RSS: last full bucket mean vs first full bucket mean (after ``start_turn``);
    "not measured" (None) with fewer than two full buckets."""
    rows = df if start_turn is None else df[df["turn"] >= start_turn]
    out: dict[str, Any] = {
        "first_bytes": None,
        "last_bytes": None,
        "drift_pct": None,
        "reason": NOT_MEASURED,
    }
    if rows.empty or "rss_bytes" not in rows:
        return out
    full = full_buckets(rows, by, size)
    if len(full) < 2:
        return out
    buckets = bucket_of(rows, by, size)
    first = float(rows.loc[buckets == full[0], "rss_bytes"].mean())
    last = float(rows.loc[buckets == full[-1], "rss_bytes"].mean())
    out.update(
        first_bytes=first,
        last_bytes=last,
        drift_pct=100.0 * (last - first) / first if first else None,
        reason=f"first full bucket {full[0]} vs last full bucket {full[-1]}",
    )
    return out


def repetition_rate(token_ids: list[int], n: int = 4) -> float:
    """Share of repeated n-grams in one reply: ``1 - distinct / total`` (0 if too short)."""
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    return 0.0 if not grams else 1.0 - len(set(grams)) / len(grams)


LATENCY_COLUMNS = (
    "turn_latency_s",
    "append_latency_s",
    "first_token_s",
    "generate_s",
    "decode_s_per_token",
)


def with_turn_latency(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``turn_latency_s`` = append + generate seconds (append alone when the
    table has no ``generate_s``); an existing ``turn_latency_s`` is kept."""
    if "turn_latency_s" in df or "append_latency_s" not in df:
        return df
    gen = df["generate_s"].fillna(0.0) if "generate_s" in df else 0.0
    return df.assign(turn_latency_s=df["append_latency_s"] + gen)


def percentiles(values: pd.Series) -> dict:
    """``p50``, ``p95`` (linear interpolation) and ``mean`` of the non-missing values; all
    None when there are none."""
    v = values.dropna().astype(float)
    if v.empty:
        return {"p50": None, "p95": None, "mean": None, "count": 0}
    return {
        "p50": float(v.quantile(0.5)),
        "p95": float(v.quantile(0.95)),
        "mean": float(v.mean()),
        "count": int(len(v)),
    }


def latency_percentiles(df: pd.DataFrame) -> dict:
    """p50 / p95 / mean (seconds) of every latency column present."""
    df = with_turn_latency(df)
    return {col: percentiles(df[col]) for col in LATENCY_COLUMNS if col in df}


def kv_live_range(df: pd.DataFrame) -> dict:
    """Minimum, mean and maximum ``kv_live_bytes`` over the turns (None without turns)."""
    v = df["kv_live_bytes"].dropna() if "kv_live_bytes" in df else pd.Series(dtype=float)
    if v.empty:
        return {"min_bytes": None, "mean_bytes": None, "max_bytes": None}
    return {"min_bytes": int(v.min()), "mean_bytes": float(v.mean()), "max_bytes": int(v.max())}


def bucket_table(
    df: pd.DataFrame,
    by: str = "turns",
    size: float | None = None,
    column: str = "turn_latency_s",
) -> list[dict]:
    """One row per bucket (by ``turns`` or wall ``time``): ``index``, ``turns`` (rows in
    it), ``full`` (see :func:`full_buckets`), ``p50_s`` / ``p95_s`` / ``mean_s`` of
    ``column`` and ``kv_live_bytes_mean``. Empty buckets in between are not listed."""
    df = with_turn_latency(df)
    if df.empty:
        return []
    buckets = bucket_of(df, by, size)
    full = set(full_buckets(df, by, size))
    rows = []
    for b in sorted(buckets.unique()):
        part = df[buckets == b]
        stats = percentiles(part[column]) if column in part else percentiles(pd.Series(dtype=float))
        kv = part["kv_live_bytes"].dropna() if "kv_live_bytes" in part else pd.Series(dtype=float)
        rows.append(
            {
                "index": int(b),
                "turns": int(len(part)),
                "full": int(b) in full,
                "p50_s": stats["p50"],
                "p95_s": stats["p95"],
                "mean_s": stats["mean"],
                "kv_live_bytes_mean": float(kv.mean()) if len(kv) else None,
            }
        )
    return rows


VERDICTS = ("kv_bounded", "prefill_bounded", "prefill_flat_vs_history")


def prefill_gates(tolerance: float = PREFILL_TOLERANCE, direction: str = "increase") -> dict:
    """The two prefill gates' thresholds, as every report states them beside the verdicts."""
    return {
        "prefill_bounded": {
            "test": "last full bucket p50 vs first full bucket p50 of append latency",
            "tolerance": float(tolerance),
            "direction": direction,
            "percentile": "numpy linear",
        },
        "prefill_flat_vs_history": {
            "test": "append latency vs history length: slope 95% CI contains 0, and the last "
            "full bucket p50 within tolerance of the first in either direction",
            "tolerance": float(tolerance),
            "direction": "both",
            "slope_ci": 0.95,
        },
    }


def aggregate_arm(
    df: pd.DataFrame,
    *,
    budget_tokens: int | None,
    budget_bytes: int | None,
    turns_per_bucket: int = TURNS_PER_BUCKET,
    seconds_per_bucket: float = SECONDS_PER_BUCKET,
    prefill_tolerance: float = PREFILL_TOLERANCE,
    prefill_direction: str = "increase",
) -> dict:
    """Every aggregate of one arm, by turns and by time.

    Report fields: ``turns``, ``errors``, ``duration_s`` (wall time of the arm's last
    turn), ``latency`` (p50/p95/mean per latency column), ``kv_live_bytes`` (min/mean/max),
    ``buckets_by_turns`` and ``buckets_by_time`` (:func:`bucket_table`, with
    ``turns_per_bucket`` and ``seconds_per_bucket`` beside), ``kv_bounded_by_{turns,time}``
    ``prefill_bounded_by_{turns,time}`` (the reference gate, :func:`prefill_bounded`, with
    ``prefill_tolerance`` and ``prefill_direction``) and
    ``prefill_flat_vs_history_by_{turns,time}`` (the stricter slope test,
    :func:`prefill_flat_vs_history`, with the same tolerance in both directions) as full
    verdicts, ``verdicts`` (their booleans) and ``gates`` (each gate's thresholds);
    ``kv_bounded`` / ``prefill_bounded`` / ``prefill_flat_vs_history`` are the turn-bucket
    verdicts. Turns with an ``error`` are counted, never measured; an arm without a
    successful turn passes no gate."""
    check_prefill_gate(prefill_tolerance, prefill_direction)
    ok = df[df["error"].isna()] if "error" in df else df
    out: dict = {"turns": int(len(df)), "errors": int(len(df) - len(ok))}
    wall = df["wall_s"].dropna() if "wall_s" in df else pd.Series(dtype=float)
    out["duration_s"] = float(wall.max()) if len(wall) else None
    out["turns_per_bucket"] = int(turns_per_bucket)
    out["seconds_per_bucket"] = float(seconds_per_bucket)
    out["latency"] = latency_percentiles(ok)
    out["kv_live_bytes"] = kv_live_range(ok)
    out["buckets_by_turns"] = bucket_table(ok, "turns", turns_per_bucket)
    out["buckets_by_time"] = bucket_table(ok, "time", seconds_per_bucket)
    out["gates"] = prefill_gates(prefill_tolerance, prefill_direction)
    if ok.empty:
        for kind in VERDICTS:
            out[kind] = False
        out["verdicts"] = {kind: {"by_turns": False, "by_time": False} for kind in VERDICTS}
        out["reason"] = "no successful turns"
        return out
    start = first_full_turn(ok, budget_tokens)
    for by, size in (("turns", turns_per_bucket), ("time", seconds_per_bucket)):
        out[f"kv_bounded_by_{by}"] = kv_bounded(
            ok, budget_tokens=budget_tokens, budget_bytes=budget_bytes, by=by, size=size
        )
        out[f"prefill_bounded_by_{by}"] = prefill_bounded(
            ok,
            budget_tokens=budget_tokens,
            by=by,
            size=size,
            tolerance=prefill_tolerance,
            direction=prefill_direction,
        )
        out[f"prefill_flat_vs_history_by_{by}"] = prefill_flat_vs_history(
            ok, budget_tokens=budget_tokens, by=by, size=size, tolerance=prefill_tolerance
        )
        out[f"latency_drift_p50_by_{by}"] = {
            col: latency_drift_p50(ok, col, by=by, size=size, start_turn=start)
            for col in ("append_latency_s", "first_token_s", "decode_s_per_token")
            if col in ok
        }
    for kind in VERDICTS:
        out[kind] = bool(out[f"{kind}_by_turns"]["bounded"])
    out["verdicts"] = {
        kind: {f"by_{by}": bool(out[f"{kind}_by_{by}"]["bounded"]) for by in ("turns", "time")}
        for kind in VERDICTS
    }
    out["rss_drift"] = rss_drift(ok, start_turn=start, size=turns_per_bucket)
    out["eos_rate"] = float((ok["stop_reason"] == "eos").mean())
    speculation = speculation_summary(ok)
    if speculation is not None:
        out["speculation"] = speculation
    if "repetition" in ok:
        out["repetition_rate"] = float(ok["repetition"].mean())
    out["first_full_turn"] = start
    drift = out["latency_drift_p50_by_turns"]["append_latency_s"]
    ratio = (
        drift["last_p50_s"] / drift["first_p50_s"]
        if drift["first_p50_s"] and drift["last_p50_s"] is not None
        else None
    )
    out["append_latency_last_over_first_bucket"] = (
        float(ratio) if ratio is not None and math.isfinite(ratio) else None
    )
    return out


def speculation_summary(ok: pd.DataFrame) -> dict | None:
    """A speculative arm's drafting over its successful turns: draft tokens ``proposed``,
    ``accepted``, ``acceptance_rate`` (accepted / proposed) and ``tokens_per_forward``
    (generated tokens per verifier forward, from the per-turn ``tau``, when recorded);
    None for an arm that never drafted."""
    if "proposed" not in ok or "accepted" not in ok:
        return None
    proposed = int(ok["proposed"].fillna(0).sum())
    if proposed == 0:
        return None
    accepted = int(ok["accepted"].fillna(0).sum())
    out: dict = {
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed,
        "tokens_per_forward": None,
    }
    if "tau" in ok and ok["tau"].notna().any():
        rows = ok[ok["tau"].notna() & (ok["tau"] > 0)]
        forwards = float((rows["generated_tokens"] / rows["tau"]).sum())
        if forwards > 0:
            out["tokens_per_forward"] = float(rows["generated_tokens"].sum()) / forwards
    return out
