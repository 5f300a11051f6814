"""The long-run report fields on hand-made tables whose right answers are known."""

from __future__ import annotations

import pandas as pd
import pytest

from kakeya_lab.bench.aggregate import (
    aggregate_arm,
    bucket_table,
    kv_live_range,
    latency_percentiles,
)
from kakeya_lab.bench.long_run import long_run_headline
from kakeya_lab.plots import bucket_figure, prefill_history_figure


def table(latency, kv, wall, cache_len=None, generate=None):
    n = len(latency)
    return pd.DataFrame(
        {
            "turn": range(n),
            "append_latency_s": latency,
            "generate_s": generate or [0.0] * n,
            "kv_live_bytes": kv,
            "cache_len": cache_len or [8] * n,
            "history_len": [10 * (i + 1) for i in range(n)],
            "wall_s": wall,
            "stop_reason": ["eos"] * n,
            "rss_bytes": [1000] * n,
            "error": [None] * n,
        }
    )


def test_bucket_tables_by_time_and_by_turns():
    df = table(
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [100, 200, 300, 300, 300, 300], [0, 10, 20, 30, 40, 50]
    )
    by_time = bucket_table(df, "time", 20)  # buckets [0,20) [20,40) [40,60)
    assert [b["index"] for b in by_time] == [0, 1, 2] and [b["turns"] for b in by_time] == [2, 2, 2]
    assert by_time[0]["p50_s"] == pytest.approx(1.5) and by_time[0]["p95_s"] == pytest.approx(1.95)
    assert [b["kv_live_bytes_mean"] for b in by_time] == [150.0, 300.0, 300.0]
    assert [b["full"] for b in by_time] == [True, True, False]  # the last one stopped at 10 s of 20
    by_turns = bucket_table(df, "turns", 4)
    assert [b["turns"] for b in by_turns] == [4, 2] and [b["full"] for b in by_turns] == [
        True,
        False,
    ]
    assert by_turns[0]["p50_s"] == pytest.approx(2.5) and by_turns[0]["p95_s"] == pytest.approx(
        3.85
    )
    # control: other numbers give other rows (the table reads the data, not its shape)
    other = bucket_table(df.assign(append_latency_s=[9.0] * 6), "time", 20)
    assert other[0]["p50_s"] == pytest.approx(9.0) != by_time[0]["p50_s"]
    assert bucket_table(df.iloc[0:0], "time", 20) == []


def test_turn_latency_is_append_plus_generate_and_p95_beside_p50():
    df = table([1.0] * 20, [5] * 20, list(range(20)), generate=[float(i) for i in range(20)])
    lat = latency_percentiles(df)
    assert lat["turn_latency_s"]["p50"] == pytest.approx(1 + 9.5)
    assert lat["turn_latency_s"]["p95"] == pytest.approx(1 + 18.05)
    assert lat["append_latency_s"]["p50"] == lat["append_latency_s"]["p95"] == 1.0
    assert lat["generate_s"]["p95"] > lat["generate_s"]["p50"]  # control: a spread is seen as one


def test_kv_range_and_counts():
    df = table([0.1] * 4, [100, 400, 250, 250], [0, 1, 2, 3])
    assert kv_live_range(df) == {"min_bytes": 100, "mean_bytes": 250.0, "max_bytes": 400}
    df.loc[3, "error"] = "turn 3: boom"
    out = aggregate_arm(
        df, budget_tokens=8, budget_bytes=400, turns_per_bucket=2, seconds_per_bucket=2
    )
    assert out["turns"] == 4 and out["errors"] == 1 and out["duration_s"] == 3.0
    assert out["kv_live_bytes"] == {
        "min_bytes": 100,
        "mean_bytes": 250.0,
        "max_bytes": 400,
    }  # failed turn left out


def test_turn_and_time_verdicts_can_disagree_and_both_are_shown():
    # flat by 3-turn buckets (means 396.67 and 396.67), not by 50 s buckets (398 vs 390)
    df = table([0.1, 0.12] * 3, [400, 400, 390, 400, 400, 390], [0, 1, 2, 3, 4, 100])
    out = aggregate_arm(
        df, budget_tokens=8, budget_bytes=400, turns_per_bucket=3, seconds_per_bucket=50
    )
    assert out["verdicts"]["kv_bounded"] == {"by_turns": True, "by_time": False}
    assert out["kv_bounded_by_time"]["bucket_means"] == [398.0, 390.0]
    assert out["kv_bounded"] is True  # the headline verdict stays the turn-bucket one
    head = long_run_headline({"sink_window": out})["sink_window"]
    assert head["kv_bounded"] is True and head["kv_bounded_by_time"] is False
    assert head["kv_live_bytes_min"] == 390 and head["kv_live_bytes_max"] == 400
    assert head["turn_latency_p95_s"] > head["turn_latency_p50_s"]
    # control: truly flat KV is bounded both ways
    flat = aggregate_arm(
        df.assign(kv_live_bytes=400),
        budget_tokens=8,
        budget_bytes=400,
        turns_per_bucket=3,
        seconds_per_bucket=50,
    )
    assert flat["verdicts"]["kv_bounded"] == {"by_turns": True, "by_time": True}


def test_bucket_figures_plot_the_report_tables():
    df = table([1.0, 2.0, 3.0, 4.0], [100, 200, 300, 400], [0, 10, 20, 30])
    summary = {
        "sink_window": aggregate_arm(
            df, budget_tokens=8, budget_bytes=400, turns_per_bucket=2, seconds_per_bucket=20
        )
    }
    fig = bucket_figure(summary, "time")
    p50, p95, kv = fig.data
    assert list(p50.y) == pytest.approx([1500.0, 3500.0]) and list(p95.y) == pytest.approx(
        [1950.0, 3950.0]
    )
    assert list(p50.x) == pytest.approx([0.0, 20 / 60])
    assert list(kv.y) == pytest.approx([150 / 2**20, 350 / 2**20])
    assert list(bucket_figure(summary, "turns").data[0].x) == [0, 2]
    with pytest.raises(ValueError, match="'time' or 'turns'"):
        bucket_figure(summary, "hours")


def test_prefill_history_figure_draws_the_fitted_slope_of_each_arm():
    # append latency = 1 ms + 2 us per history token exactly: the fitted line is that line
    df = table([0.001 + 2e-6 * 10 * (i + 1) for i in range(6)], [400] * 6, list(range(6)))
    df = df.assign(arm="http_stateless")
    flat = table([0.003] * 6, [400] * 6, list(range(6))).assign(arm="grpc_session")
    both = pd.concat([df, flat], ignore_index=True)
    summary = {
        arm: aggregate_arm(part, budget_tokens=None, budget_bytes=None, turns_per_bucket=2)
        for arm, part in both.groupby("arm", sort=False)
    }
    fits = {arm: s["prefill_flat_vs_history_by_turns"] for arm, s in summary.items()}
    fig = prefill_history_figure(both, fits)
    points, line, flat_points, flat_line = fig.data
    assert list(points.x) == [10, 20, 30, 40, 50, 60]
    assert list(line.x) == [10, 60]
    assert list(line.y) == pytest.approx([1.02, 1.12])  # ms, on the exact line
    assert list(flat_line.y) == pytest.approx([3.0, 3.0])
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("http_stateless: 2.00 us/token")
    # an arm without a fit is drawn without a line and says why
    lone = prefill_history_figure(both, {"http_stateless": fits["http_stateless"]})
    assert len(lone.data) == 3
    assert "grpc_session: not fitted (no verdict)" in [a.text for a in lone.layout.annotations]
