"""What a served long run produced: :class:`ServedRun` (the per-turn table, every arm's
summary, the run-level report fields) and :func:`summarize_served`, the aggregates of every
served arm against the server's cache budget (both prefill gates)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

from kakeya_lab.bench.aggregate import aggregate_arm, bucket_table

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run.served import Endpoints


@dataclass
class ServedRun:
    """A served long run: the per-turn ``turns`` (one row per arm and turn), every arm's
    ``summary`` (:func:`summarize_served`), the server's ``cache`` figures and model.
    ``partial``: the run is not over (a periodic report, or a run stopped early:
    ``abort_reason`` names why — a signal, e.g. ``"SIGTERM"``, or ``"max_errors"`` with
    ``abort_detail``); ``duration_s``: wall time so far; ``events``: session re-creations
    (``resume``, ``server_restart``, ``after_error``) and server outages, each with its
    arm, turn and wall time."""

    turns: pd.DataFrame
    summary: dict[str, dict]
    cache: dict
    model: str
    endpoints: Endpoints
    partial: bool = False
    abort_reason: str | None = None
    abort_detail: str | None = None
    duration_s: float = 0.0
    events: list[dict] = field(default_factory=list)

    def report_fields(self) -> dict:
        """The run-level report fields: ``partial``, ``abort_reason``, ``duration_s`` (and
        ``abort_detail`` when there is one)."""
        out: dict = {
            "partial": self.partial,
            "abort_reason": self.abort_reason,
            "duration_s": self.duration_s,
        }
        if self.abort_detail is not None:
            out["abort_detail"] = self.abort_detail
        return out


def summarize_served(
    table: pd.DataFrame,
    cache: dict,
    *,
    turns_per_bucket: int = 50,
    seconds_per_bucket: float = 600.0,
    prefill_tolerance: float = 0.10,
    prefill_direction: str = "increase",
) -> dict[str, dict]:
    """:func:`~kakeya_lab.bench.aggregate.aggregate_arm` of every served arm, against the
    server's budget (``cache`` from :func:`server_cache`), with both prefill gates.

    A row with ``measured`` False (an ``http_reuse`` turn that re-prefilled the whole
    conversation because its server-side session was gone: after a resume or a server
    restart) is counted in ``unmeasured_turns``, not aggregated."""
    budget_tokens = cache.get("budget_tokens") or None
    budget_bytes = cache.get("kv_budget_bytes") or None
    out = {}
    for arm, df in table.groupby("arm", sort=False):
        measured = df[df["measured"].fillna(True).astype(bool)] if "measured" in df else df
        summary = aggregate_arm(
            measured,
            budget_tokens=budget_tokens,
            budget_bytes=budget_bytes,
            turns_per_bucket=turns_per_bucket,
            seconds_per_bucket=seconds_per_bucket,
            prefill_tolerance=prefill_tolerance,
            prefill_direction=prefill_direction,
        )
        summary["budget_bytes"] = budget_bytes
        summary["unmeasured_turns"] = int(len(df) - len(measured))
        for column in ("server_restart", "resumed"):
            if column in df:
                summary[f"{column}_turns"] = int(df[column].fillna(False).astype(bool).sum())
        if "session_epoch" in df and df["session_epoch"].notna().any():
            summary["session_epochs"] = int(df["session_epoch"].max()) + 1
        summary.update(
            append_latency_buckets(
                measured, turns_per_bucket=turns_per_bucket, seconds_per_bucket=seconds_per_bucket
            )
        )
        out[str(arm)] = summary
    return out


def append_latency_buckets(
    df: pd.DataFrame, *, turns_per_bucket: int = 50, seconds_per_bucket: float = 600.0
) -> dict[str, list[dict]]:
    """One arm's per-turn prefill (``append_latency_s``: the server-measured prefill of the
    turn's new tokens) by turn buckets and by wall-clock buckets
    (:func:`~kakeya_lab.bench.aggregate.bucket_table` rows: p50_s, p95_s, turns, full)."""
    ok = df[df["error"].isna()] if "error" in df else df
    return {
        "append_buckets_by_turns": bucket_table(ok, "turns", turns_per_bucket, "append_latency_s"),
        "append_buckets_by_time": bucket_table(ok, "time", seconds_per_bucket, "append_latency_s"),
    }
