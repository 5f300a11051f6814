"""Summaries of a long run: the aggregates of every arm, recall probes, the index headline."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from kakeya_lab.bench.aggregate import aggregate_arm, first_full_turn, latency_drift_p50
from kakeya_lab.bench.long_run.arms import Arm


def summarize_long_run(
    table: pd.DataFrame,
    arms: Mapping[str, Arm],
    budget_bytes: Mapping[str, int | None],
    *,
    turns_per_bucket: int = 50,
    seconds_per_bucket: float = 600.0,
    prefill_tolerance: float = 0.10,
    prefill_direction: str = "increase",
) -> dict[str, dict]:
    """:func:`~kakeya_lab.bench.aggregate.aggregate_arm` for every arm, plus quality probes.
    ``budget_bytes``: the analytic KV budget per arm (None for caches that never evict);
    ``prefill_tolerance`` / ``prefill_direction``: the reference prefill gate's thresholds."""
    out = {}
    for name, arm in arms.items():
        df = table[table["arm"] == name]
        summary = aggregate_arm(
            df,
            budget_tokens=arm.config.budget,
            budget_bytes=budget_bytes[name],
            turns_per_bucket=turns_per_bucket,
            seconds_per_bucket=seconds_per_bucket,
            prefill_tolerance=prefill_tolerance,
            prefill_direction=prefill_direction,
        )
        summary["budget_bytes"] = budget_bytes[name]
        if "probe_recalled" in df and df["probe_recalled"].notna().any():
            probes = df[df["probe_recalled"].notna()]
            summary["probes"] = [
                {
                    "turn": int(r.turn),
                    "distance_tokens": int(r.probe_distance_tokens),
                    "recalled": bool(r.probe_recalled),
                }
                for r in probes.itertuples()
            ]
            summary["recall_rate"] = float(probes["probe_recalled"].astype(bool).mean())
        out[name] = summary
    plain = PLAIN_ARM if PLAIN_ARM in arms else None
    for name, arm in arms.items():
        if arm.proposer is not None and plain is not None:
            out[name]["matches_plain"] = replies_match(table, name, plain)
            start = first_full_turn(table[table["arm"] == name], arm.config.budget)
            for key, column in (
                ("decode_over_plain", "decode_s_per_token"),
                ("step_over_plain", "step_s"),
            ):
                out[name][key] = relative_drift(
                    table, name, plain, column, turns_per_bucket=turns_per_bucket, start_turn=start
                )
    return out


PLAIN_ARM = "sink_window"  # the plain greedy arm a speculative arm's replies must equal


def replies_match(table: pd.DataFrame, arm: str, plain: str) -> dict:
    """Per-turn equality of ``arm``'s reply token ids with ``plain``'s, on every turn both
    completed (compared by ``reply_ids_sha256``): ``turns_compared``, ``turns_equal``,
    ``first_mismatch_turn`` (None when all are equal), ``plain_arm``."""
    if "reply_ids_sha256" not in table:
        return {
            "plain_arm": plain,
            "turns_compared": 0,
            "turns_equal": 0,
            "first_mismatch_turn": None,
        }
    ok = table[table["error"].isna() & table["reply_ids_sha256"].notna()]
    ours = ok[ok["arm"] == arm].set_index("turn")["reply_ids_sha256"]
    theirs = ok[ok["arm"] == plain].set_index("turn")["reply_ids_sha256"]
    both = sorted(set(ours.index) & set(theirs.index))
    mismatches = [t for t in both if ours[t] != theirs[t]]
    return {
        "plain_arm": plain,
        "turns_compared": len(both),
        "turns_equal": len(both) - len(mismatches),
        "first_mismatch_turn": int(mismatches[0]) if mismatches else None,
    }


def relative_drift(
    table: pd.DataFrame,
    arm: str,
    plain: str,
    column: str = "decode_s_per_token",
    *,
    turns_per_bucket: int = 50,
    start_turn: int | None = None,
) -> dict:
    """Drift of ``arm``'s ``column`` relative to ``plain``'s in the same rounds: the per-turn
    ratio ``arm / plain``, its p50 per turn bucket, last full bucket vs first (as
    :func:`~kakeya_lab.bench.aggregate.latency_drift_p50`, with ``ratio`` in place of
    seconds). Arms alternate turn by turn, so what the machine's load does to both cancels
    out; what is left is the arm's own change with the history.

    ``column="step_s"``: seconds per verifier forward, ``generate_s · tau /
    generated_tokens`` (tau missing: one token per forward) — the cost of a step, which
    unlike the cost per token does not move with how many drafts the content lets land."""
    ok = table[table["error"].isna()] if "error" in table else table
    if column == "step_s":
        tau = ok["tau"].fillna(1.0) if "tau" in ok else 1.0
        ok = ok.assign(step_s=ok["generate_s"] * tau / ok["generated_tokens"].clip(lower=1))
    ours = ok[ok["arm"] == arm].set_index("turn")[column]
    theirs = ok[ok["arm"] == plain].set_index("turn")[column]
    both = sorted(set(ours.index) & set(theirs.index))
    ratios = pd.DataFrame({"turn": both, "ratio": [float(ours[t] / theirs[t]) for t in both]})
    drift = latency_drift_p50(
        ratios, "ratio", by="turns", size=turns_per_bucket, start_turn=start_turn
    )
    out = {k[:-2] if k.endswith("_s") else k: v for k, v in drift.items()}
    out.update(column=column, plain_arm=plain, turns_compared=len(both))
    out["median_ratio"] = float(ratios["ratio"].median()) if len(both) else None
    return out


def long_run_headline(summary: dict[str, dict]) -> dict[str, dict]:
    """The few numbers per arm that the run index shows."""
    out = {}
    for arm, s in summary.items():
        drift = s.get("latency_drift_p50_by_turns", {}).get("append_latency_s", {})
        verdicts = s.get("verdicts", {})
        turn_latency = (s.get("latency") or {}).get("turn_latency_s") or {}
        kv = s.get("kv_live_bytes") or {}
        out[arm] = {
            "turns": s.get("turns"),
            "errors": s.get("errors"),
            "duration_s": s.get("duration_s"),
            "kv_bounded": s.get("kv_bounded"),
            "prefill_bounded": s.get("prefill_bounded"),
            "prefill_flat_vs_history": s.get("prefill_flat_vs_history"),
            "kv_bounded_by_time": (verdicts.get("kv_bounded") or {}).get("by_time"),
            "prefill_bounded_by_time": (verdicts.get("prefill_bounded") or {}).get("by_time"),
            "prefill_flat_vs_history_by_time": (verdicts.get("prefill_flat_vs_history") or {}).get(
                "by_time"
            ),
            "prefill_gates": s.get("gates"),
            "turn_latency_p50_s": turn_latency.get("p50"),
            "turn_latency_p95_s": turn_latency.get("p95"),
            "kv_live_bytes_min": kv.get("min_bytes"),
            "kv_live_bytes_mean": kv.get("mean_bytes"),
            "kv_live_bytes_max": kv.get("max_bytes"),
            "append_p50_drift_pct": drift.get("drift_pct"),
            "append_last_over_first_bucket": s.get("append_latency_last_over_first_bucket"),
            "rss_drift_pct": (s.get("rss_drift") or {}).get("drift_pct"),
            "recall_rate": s.get("recall_rate"),
        }
        if "matches_plain" in s:
            out[arm]["matches_plain"] = s["matches_plain"]
    return out
