"""Long-run aggregates on hand-made tables with hand-computed expectations."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kakeya_lab.bench.aggregate import (
    aggregate_arm,
    kv_bounded,
    latency_drift_p50,
    prefill_bounded,
    repetition_rate,
)


def table(kv, latency, cache_len, history=None, wall=None):
    n = len(kv)
    return pd.DataFrame(
        {
            "turn": range(n),
            "kv_live_bytes": kv,
            "append_latency_s": latency,
            "cache_len": cache_len,
            "history_len": history or [10 * (i + 1) for i in range(n)],
            "wall_s": wall or [60.0 * i for i in range(n)],
            "stop_reason": ["eos"] * (n // 2) + ["max_tokens"] * (n - n // 2),
            "rss_bytes": [1000] * n,
            "error": [None] * n,
        }
    )


def test_kv_bounded_flat_after_fill():
    # fills at turn 2 (cache_len 8 = budget); buckets of 2 turns after that
    df = table([100, 200, 400, 400, 400, 400], [0.1] * 6, [2, 4, 8, 8, 8, 8])
    out = kv_bounded(df, budget_tokens=8, budget_bytes=400, by="turns", size=2)
    assert out["bounded"] and out["first_full_turn"] == 2
    assert out["bucket_means"] == [400.0, 400.0]


def test_kv_bounded_rejects_growth_budget_and_degenerate():
    grow = table([100, 200, 400, 420, 440, 460], [0.1] * 6, [2, 4, 8, 8, 8, 8])
    out = kv_bounded(grow, budget_tokens=8, budget_bytes=1000, by="turns", size=2)
    # first full bucket: turns 2-3 mean 410; last: turns 4-5 mean 450 -> 9.8% > 1%
    assert not out["bounded"] and out["max_relative_deviation"] == pytest.approx(40 / 410)
    over = table([100, 500, 500, 500], [0.1] * 4, [2, 8, 8, 8])
    assert (
        kv_bounded(over, budget_tokens=8, budget_bytes=400, size=1)["reason"]
        == "above the analytic budget"
    )
    zero = table([0, 0, 0, 0], [0.1] * 4, [8, 8, 8, 8])
    assert "zero" in kv_bounded(zero, budget_tokens=8, budget_bytes=400, size=1)["reason"]
    empty = table([], [], [])
    assert kv_bounded(empty, budget_tokens=8, budget_bytes=400)["reason"] == "no turns"
    never = table([1, 2, 3], [0.1] * 3, [1, 2, 3])
    assert (
        kv_bounded(never, budget_tokens=8, budget_bytes=400, size=1)["reason"]
        == "the cache never filled"
    )
    full_cache = table([1, 2, 3], [0.1] * 3, [1, 2, 3])
    assert not kv_bounded(full_cache, budget_tokens=None, budget_bytes=None)["bounded"]


def test_latency_drift_by_turn_buckets_and_time_buckets():
    df = table([1] * 4, [0.10, 0.30, 0.20, 0.60], [8] * 4, wall=[0, 100, 700, 1190])
    by_turns = latency_drift_p50(df, by="turns", size=2)  # p50 0.2 -> 0.4
    assert by_turns["first_p50_s"] == pytest.approx(0.2) and by_turns[
        "last_p50_s"
    ] == pytest.approx(0.4)
    assert by_turns["drift_s"] == pytest.approx(0.2) and by_turns["drift_pct"] == pytest.approx(
        100.0
    )
    by_time = latency_drift_p50(df, by="time", size=600)  # same split by wall time
    assert by_time["drift_pct"] == pytest.approx(100.0)
    assert latency_drift_p50(df.iloc[0:0])["drift_s"] is None


def test_drift_over_fewer_than_two_full_buckets_is_not_measured():
    df = table([1] * 4, [0.10, 0.30, 0.20, 0.60], [8] * 4, wall=[0, 100, 700, 800])
    one = latency_drift_p50(df, by="turns", size=4)  # one bucket: compared with itself
    assert one["drift_s"] is None and one["drift_pct"] is None and "not measured" in one["reason"]
    partial = latency_drift_p50(df, by="turns", size=3)  # bucket 1 holds one turn of three
    assert partial["full_buckets"] == 1 and partial["drift_s"] is None
    short = latency_drift_p50(df, by="time", size=600)  # the run stopped 200 s into bucket 1
    assert short["full_buckets"] == 1 and short["drift_pct"] is None
    out = aggregate_arm(df, budget_tokens=8, budget_bytes=400, turns_per_bucket=4)
    assert out["append_latency_last_over_first_bucket"] is None
    assert out["rss_drift"]["drift_pct"] is None and "not measured" in out["rss_drift"]["reason"]
    assert (
        "not measured" in out["prefill_bounded_by_turns"]["reason"] and not out["prefill_bounded"]
    )


def test_prefill_bounded_slope_and_drift():
    flat = table([1] * 8, [0.1, 0.12, 0.1, 0.12, 0.1, 0.12, 0.1, 0.12], [8] * 8)
    out = prefill_bounded(flat, budget_tokens=8, size=4)
    assert out["bounded"], out["reason"]
    lo, hi = out["slope_ci95"]
    assert lo <= 0 <= hi
    growing = table([1] * 8, [0.1 * (i + 1) for i in range(8)], [8] * 8)
    out = prefill_bounded(growing, budget_tokens=None, size=4)
    assert not out["bounded"] and out["slope_s_per_token"] == pytest.approx(0.01)
    assert "grows" in out["reason"]
    assert prefill_bounded(flat.iloc[0:0], budget_tokens=8)["reason"] == "no turns"


def test_prefill_bounded_adjusts_for_message_length():
    # Later messages are shorter: a session-bound arm's append latency falls with history
    # although nothing depends on history. The partial slope (user_tokens as a covariate)
    # and the length-adjusted bucket p50s see it flat; the simple slope would not.
    rng = np.random.default_rng(0)
    n = 40
    history = [1000 + 40 * i for i in range(n)]
    message = [60 - i + int(k) for i, k in enumerate(rng.integers(0, 8, n))]
    noise = rng.normal(0, 0.002, n)
    latency = [0.05 + 0.003 * m + e for m, e in zip(message, noise)]
    df = table([1] * n, latency, [8] * n, history=history).assign(user_tokens=message)
    out = prefill_bounded(df, budget_tokens=8, size=10)
    assert out["covariate"] == "user_tokens"
    assert out["message_s_per_token"] == pytest.approx(0.003, rel=0.1)
    assert out["bounded"], out["reason"]
    simple = prefill_bounded(df.drop(columns="user_tokens"), budget_tokens=8, size=10)
    assert simple["covariate"] is None and not simple["bounded"]
    assert simple["slope_ci95"][1] < 0  # the confound the covariate removes
    # Growth with history still shows through the covariate (what a stateless arm does).
    grown = df.assign(append_latency_s=df["append_latency_s"] + 2e-4 * df["history_len"])
    out = prefill_bounded(grown, budget_tokens=8, size=10)
    assert not out["bounded"] and "grows" in out["reason"]
    assert out["slope_s_per_token"] == pytest.approx(2e-4, rel=0.1)


def test_aggregate_arm_all_errors_and_rates():
    df = table([400] * 4, [0.1] * 4, [8] * 4)
    df["error"] = "boom"
    out = aggregate_arm(df, budget_tokens=8, budget_bytes=400)
    assert (
        out["kv_bounded"] is False and out["reason"] == "no successful turns" and out["errors"] == 4
    )
    ok = table([100, 400, 400, 400, 400], [0.1] * 5, [4, 8, 8, 8, 8])
    out = aggregate_arm(ok, budget_tokens=8, budget_bytes=400, turns_per_bucket=2)
    assert out["kv_bounded"] and out["eos_rate"] == pytest.approx(2 / 5)


def test_repetition_rate():
    assert repetition_rate([1, 2, 3]) == 0.0
    assert repetition_rate([1, 2, 3, 4, 5]) == 0.0
    assert repetition_rate([7, 7, 7, 7, 7, 7]) == pytest.approx(1 - 1 / 3)
