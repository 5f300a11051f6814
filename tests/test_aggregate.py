"""Long-run aggregates on hand-made tables with hand-computed expectations."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kakeya_lab.bench.aggregate import (
    aggregate_arm,
    kv_bounded,
    latency_drift_p50,
    p50,
    percentiles,
    prefill_bounded,
    prefill_flat_vs_history,
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
    for gate in ("prefill_bounded", "prefill_flat_vs_history"):
        assert "not measured" in out[f"{gate}_by_turns"]["reason"] and not out[gate]


def test_prefill_flat_vs_history_slope_and_drift():
    flat = table([1] * 8, [0.1, 0.12, 0.1, 0.12, 0.1, 0.12, 0.1, 0.12], [8] * 8)
    out = prefill_flat_vs_history(flat, budget_tokens=8, size=4)
    assert out["bounded"], out["reason"]
    lo, hi = out["slope_ci95"]
    assert lo <= 0 <= hi
    growing = table([1] * 8, [0.1 * (i + 1) for i in range(8)], [8] * 8)
    out = prefill_flat_vs_history(growing, budget_tokens=None, size=4)
    assert not out["bounded"] and out["slope_s_per_token"] == pytest.approx(0.01)
    assert "grows" in out["reason"]
    assert prefill_flat_vs_history(flat.iloc[0:0], budget_tokens=8)["reason"] == "no turns"


def test_prefill_flat_vs_history_when_the_adjusted_first_p50_is_not_positive():
    # A tiny model on a busy machine: the first bucket's long messages ran fast, so its
    # length-adjusted p50 comes out below zero and a relative drift has no meaning. The
    # gate says so (a long run reports at every turn; this once failed to format).
    message = [30, 30, 30, 30, 2, 30, 2, 2, 2, 2, 30, 2]
    latency = [0.002] * 4 + [0.001 * m for m in message[4:]]
    n = len(message)
    history = [100 + 10 * (i % 4) for i in range(n)]
    df = table([1] * n, latency, [8] * n, history=history).assign(user_tokens=message)
    out = prefill_flat_vs_history(df, budget_tokens=8, size=4)
    assert out["covariate"] == "user_tokens" and out["drift"]["full_buckets"] == 3
    assert out["drift"]["first_p50_s"] < 0 and out["drift"]["drift_pct"] is None
    assert not out["bounded"] and "not defined" in out["reason"]


def test_prefill_flat_vs_history_adjusts_for_message_length():
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
    out = prefill_flat_vs_history(df, budget_tokens=8, size=10)
    assert out["covariate"] == "user_tokens"
    assert out["message_s_per_token"] == pytest.approx(0.003, rel=0.1)
    assert out["bounded"], out["reason"]
    simple = prefill_flat_vs_history(df.drop(columns="user_tokens"), budget_tokens=8, size=10)
    assert simple["covariate"] is None and not simple["bounded"]
    assert simple["slope_ci95"][1] < 0  # the confound the covariate removes
    # Growth with history still shows through the covariate (what a stateless arm does).
    grown = df.assign(append_latency_s=df["append_latency_s"] + 2e-4 * df["history_len"])
    out = prefill_flat_vs_history(grown, budget_tokens=8, size=10)
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


# ------------------------------------------------- the reference gate (prefill_bounded)


def test_percentiles_interpolate_linearly_as_numpy_does():
    # numpy's "linear" method: p50 of [1, 2, 3, 10] is halfway between 2 and 3; p95 of
    # 1..5 sits at rank 0.95 * 4 = 3.8, i.e. 4 + 0.8 * (5 - 4).
    assert p50([10, 1, 3, 2]) == 2.5
    assert p50([]) is None and p50([float("nan")]) is None
    stats = percentiles(pd.Series([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert stats["p50"] == 3.0 and stats["p95"] == pytest.approx(4.8)


def _two_buckets(first, last):
    return table([8] * 8, list(first) + list(last), [8] * 8)


def test_reference_gate_interpolates_bucket_p50s():
    # first bucket p50: (0.2 + 0.3) / 2 = 0.25; last: (0.26 + 0.27) / 2 = 0.265, +6%
    df = _two_buckets([0.1, 0.2, 0.3, 1.0], [0.25, 0.26, 0.27, 0.3])
    out = prefill_bounded(df, budget_tokens=8, size=4)
    assert out["first_p50_s"] == pytest.approx(0.25) and out["last_p50_s"] == pytest.approx(0.265)
    assert out["change_pct"] == pytest.approx(6.0) and out["bounded"], out["reason"]
    # with a 5% tolerance the same run fails (a lower-median p50 would have read 0.2 -> +30%)
    tight = prefill_bounded(df, budget_tokens=8, size=4, tolerance=0.05)
    assert not tight["bounded"] and "+6.0%" in tight["reason"] and tight["tolerance"] == 0.05


def test_reference_gate_tolerance_and_direction():
    slower = _two_buckets([0.1] * 4, [0.112] * 4)  # +12%
    faster = _two_buckets([0.1] * 4, [0.088] * 4)  # -12%
    assert not prefill_bounded(slower, budget_tokens=8, size=4)["bounded"]
    assert prefill_bounded(slower, budget_tokens=8, size=4, tolerance=0.15)["bounded"]
    # the reference default: only growth fails, so a run that got faster passes
    assert prefill_bounded(faster, budget_tokens=8, size=4)["bounded"]
    both = prefill_bounded(faster, budget_tokens=8, size=4, direction="both")
    assert not both["bounded"] and both["direction"] == "both"
    assert prefill_bounded(faster, budget_tokens=8, size=4, direction="both", tolerance=0.2)[
        "bounded"
    ]
    # exactly at the tolerance passes (10% is within 10%)
    edge = _two_buckets([0.1] * 4, [0.11] * 4)
    assert prefill_bounded(edge, budget_tokens=8, size=4)["bounded"]
    assert not prefill_bounded(edge, budget_tokens=8, size=4, tolerance=0.0)["bounded"]
    # the stricter test fails the faster run (both directions), whatever the slope says
    assert not prefill_flat_vs_history(faster, budget_tokens=8, size=4)["bounded"]
    for bad, said in (({"tolerance": -0.1}, "tolerance"), ({"direction": "down"}, "direction")):
        with pytest.raises(ValueError, match=said):
            prefill_bounded(slower, budget_tokens=8, size=4, **bad)


def test_reference_gate_on_empty_and_unfilled_runs():
    df = _two_buckets([0.1] * 4, [0.1] * 4)
    assert prefill_bounded(df.iloc[0:0], budget_tokens=8)["reason"] == "no turns"
    never = prefill_bounded(df, budget_tokens=100, size=4)
    assert not never["bounded"] and never["reason"] == "the cache never filled"
    one = prefill_bounded(df, budget_tokens=8, size=8)
    assert not one["bounded"] and "not measured" in one["reason"]


def test_both_gates_in_aggregate_arm_with_their_thresholds():
    faster = _two_buckets([0.1] * 4, [0.088] * 4)
    out = aggregate_arm(faster, budget_tokens=8, budget_bytes=400, turns_per_bucket=4)
    assert out["prefill_bounded"] is True and out["prefill_flat_vs_history"] is False
    assert set(out["verdicts"]) == {"kv_bounded", "prefill_bounded", "prefill_flat_vs_history"}
    assert out["gates"]["prefill_bounded"]["tolerance"] == 0.10
    assert out["gates"]["prefill_bounded"]["direction"] == "increase"
    assert out["gates"]["prefill_flat_vs_history"]["direction"] == "both"
    strict = aggregate_arm(
        faster,
        budget_tokens=8,
        budget_bytes=400,
        turns_per_bucket=4,
        prefill_direction="both",
        prefill_tolerance=0.05,
    )
    assert strict["prefill_bounded"] is False
    assert strict["prefill_bounded_by_turns"]["tolerance"] == 0.05
    assert strict["gates"]["prefill_bounded"] == {
        **out["gates"]["prefill_bounded"],
        "tolerance": 0.05,
        "direction": "both",
    }


def test_gates_on_all_error_and_mixed_runs():
    failed = _two_buckets([0.1] * 4, [0.1] * 4).assign(error="refused")
    out = aggregate_arm(failed, budget_tokens=8, budget_bytes=400, turns_per_bucket=4)
    assert out["errors"] == 8 and out["reason"] == "no successful turns"
    assert out["prefill_bounded"] is False and out["prefill_flat_vs_history"] is False
    assert out["verdicts"]["prefill_bounded"] == {"by_turns": False, "by_time": False}
    assert "gates" in out
    # failed turns are counted, not measured: their (huge) latencies do not move the gate
    mixed = table([8] * 12, [0.1, 0.11] * 6, [8] * 12)
    mixed.loc[[8, 9], "error"] = "refused"
    mixed.loc[[8, 9], "append_latency_s"] = 5.0
    out = aggregate_arm(mixed, budget_tokens=8, budget_bytes=400, turns_per_bucket=4)
    assert out["errors"] == 2 and out["turns"] == 12
    drift = out["prefill_bounded_by_turns"]
    assert drift["last_p50_s"] == pytest.approx(0.105) and out["prefill_bounded"], drift


def test_speculation_summary_over_successful_turns():
    ok = table([100, 400, 400, 400], [0.1] * 4, [4, 8, 8, 8])
    ok["generated_tokens"] = [10, 12, 6, 8]
    ok["proposed"] = [8, 10, 4, 100]
    ok["accepted"] = [6, 5, 4, 100]
    ok["tau"] = [2.0, 3.0, None, 4.0]
    ok.loc[3, "error"] = "boom"  # a failed turn's drafting is not counted
    spec = aggregate_arm(ok, budget_tokens=8, budget_bytes=400, turns_per_bucket=2)["speculation"]
    assert spec["proposed"] == 22 and spec["accepted"] == 15
    assert spec["acceptance_rate"] == pytest.approx(15 / 22)
    # forwards 10/2 + 12/3 = 9 over the turns with tau; their 22 tokens
    assert spec["tokens_per_forward"] == pytest.approx(22 / 9)
    ok["proposed"] = ok["accepted"] = 0  # a plain arm: no drafting block
    assert "speculation" not in aggregate_arm(ok, budget_tokens=8, budget_bytes=400)
    served = table([400] * 2, [0.1] * 2, [8] * 2).assign(
        generated_tokens=[5, 5], proposed=[4, 4], accepted=[3, 4]
    )  # served rows carry no tau
    spec = aggregate_arm(served, budget_tokens=8, budget_bytes=400)["speculation"]
    assert spec["acceptance_rate"] == pytest.approx(7 / 8) and spec["tokens_per_forward"] is None
