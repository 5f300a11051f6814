"""A long run against a running ``kakeya-lab serve``: endpoints, the server's cache budget,
and the same summaries as the in-process run (:mod:`kakeya_lab.serve.served_long_run`
drives the turns)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import pandas as pd

from kakeya_lab.bench.aggregate import aggregate_arm, bucket_table

SERVED_ARMS = ("grpc_session", "http_reuse", "http_stateless")


@dataclass(frozen=True)
class Endpoints:
    """A server's two addresses: ``grpc_target`` (``HOST:PORT``) and ``http_base``
    (``http://HOST:PORT``, no ``/v1``)."""

    grpc_target: str
    http_base: str


def parse_endpoints(values: Sequence[str]) -> Endpoints:
    """``grpc://HOST:PORT`` and ``http://HOST:PORT``, once each (the served bench needs
    both: gRPC for the session arm, HTTP for the OpenAI arms and the server's RSS).
    Raises ValueError saying what to write."""
    usage = "give both of the server's addresses: --endpoint grpc://HOST:PORT --endpoint http://HOST:PORT"
    found: dict[str, str] = {}
    for value in values:
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            port = None
        if (
            parts.scheme not in ("grpc", "http")
            or not parts.hostname
            or port is None
            or port < 1
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
        ):
            raise ValueError(f"{value!r} is not grpc://HOST:PORT or http://HOST:PORT; {usage}")
        if parts.scheme in found:
            raise ValueError(
                f"two {parts.scheme} endpoints ({found[parts.scheme]}, {value}); {usage}"
            )
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        found[parts.scheme] = f"{host}:{port}"
    missing = [s for s in ("grpc", "http") if s not in found]
    if missing:
        raise ValueError(f"no {' or '.join(missing)} endpoint; {usage}")
    return Endpoints(grpc_target=found["grpc"], http_base=f"http://{found['http']}")


def check_served_arms(names: Sequence[str]) -> list[str]:
    """The served arms asked for (ValueError for unknown, repeated or none)."""
    names = list(names)
    unknown = sorted(set(names) - set(SERVED_ARMS))
    if unknown:
        raise ValueError(
            f"unknown served arm(s) {unknown} with --endpoint; known: {', '.join(SERVED_ARMS)}"
        )
    if not names:
        raise ValueError(f"no arms given; known with --endpoint: {', '.join(SERVED_ARMS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm is named twice in {names}")
    return names


def server_cache(grpc_target: str) -> dict:
    """The server's cache figures (``sink``, ``budget_tokens``, ``kv_budget_bytes``; 0
    for a cache that never evicts), read from a session opened (with one token appended)
    and closed for it."""
    from kakeya_lab.serve.client import SessionClient

    with SessionClient(grpc_target, timeout_s=600) as client:
        sid = client.create()
        try:
            # one token, so the cache has allocated its storage: an empty session's
            # kv_budget_bytes is 0 (the cache does not know its dtype yet)
            client.append_ids(sid, [0])
            info = client.info(sid)
        finally:
            client.close_session(sid)
    return {
        "sink": int(info.sink),
        "budget_tokens": int(info.budget_tokens),
        "kv_budget_bytes": int(info.kv_budget_bytes),
    }


def summarize_served(
    table: pd.DataFrame,
    cache: dict,
    *,
    turns_per_bucket: int = 50,
    seconds_per_bucket: float = 600.0,
) -> dict[str, dict]:
    """:func:`~kakeya_lab.bench.aggregate.aggregate_arm` of every served arm, against the
    server's budget (``cache`` from :func:`server_cache`)."""
    budget_tokens = cache.get("budget_tokens") or None
    budget_bytes = cache.get("kv_budget_bytes") or None
    out = {}
    for arm, df in table.groupby("arm", sort=False):
        summary = aggregate_arm(
            df,
            budget_tokens=budget_tokens,
            budget_bytes=budget_bytes,
            turns_per_bucket=turns_per_bucket,
            seconds_per_bucket=seconds_per_bucket,
        )
        summary["budget_bytes"] = budget_bytes
        summary.update(
            append_latency_buckets(
                df, turns_per_bucket=turns_per_bucket, seconds_per_bucket=seconds_per_bucket
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
