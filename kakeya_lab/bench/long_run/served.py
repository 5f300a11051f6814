"""A long run against a running ``kakeya-lab serve``: endpoints (or a loopback server started
for the run), the server's cache budget, and the same summaries as the in-process run
(:mod:`kakeya_lab.serve.served_long_run` drives the turns)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import pandas as pd

from kakeya_lab.bench.aggregate import aggregate_arm, bucket_table
from kakeya_lab.bench.long_run.settings import SERVED_ARMS, LongRunSettings


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


SERVE_HERE = "serve"


def endpoint_values(endpoint: str | Sequence[str]) -> list[str]:
    """The addresses in a notebook's ``endpoint`` parameter: a string holding both
    (``"grpc://HOST:P http://HOST:Q"``, separated by spaces or commas) or a list."""
    values = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    return [v for value in values for v in value.replace(",", " ").split() if v]


@contextmanager
def served_endpoints(
    endpoint: str | Sequence[str],
    *,
    model: str,
    sink: int,
    window: int,
    backend: str = "torch",
    timeout_s: float = 300.0,
) -> Iterator[Endpoints | None]:
    """The server a long run drives, for as long as the ``with`` block runs.

    ``endpoint`` empty: ``None`` (no served arms). ``"serve"``: a ``kakeya-lab serve`` of
    ``model`` with a ``sink`` + ``window`` cache on ``backend``, started on free loopback
    ports (ready within ``timeout_s``) and stopped (SIGTERM) when the block ends. Otherwise
    both addresses of a running server (:func:`endpoint_values`, :func:`parse_endpoints`;
    ValueError saying what to write)."""
    values = endpoint_values(endpoint)
    if not values:
        yield None
        return
    if values != [SERVE_HERE]:
        yield parse_endpoints(values)
        return
    from kakeya_lab.serve.process import start_server

    server = start_server(
        "--sink", str(sink), "--window", str(window), "--backend", backend,
        model=model, timeout_s=timeout_s,
    )  # fmt: skip
    try:
        yield Endpoints(grpc_target=server.grpc_target, http_base=server.http_base)
    finally:
        server.stop(timeout_s=30)


@dataclass
class ServedRun:
    """A served long run: the per-turn ``turns`` (one row per arm and turn), every arm's
    ``summary`` (:func:`summarize_served`), the server's ``cache`` figures and model."""

    turns: pd.DataFrame
    summary: dict[str, dict]
    cache: dict
    model: str
    endpoints: Endpoints


def run_served(
    endpoints: Endpoints,
    settings: LongRunSettings,
    user_turns: Sequence[str] | None = None,
    *,
    model: str | None = None,
    log: Callable[[str], None] | None = None,
) -> ServedRun:
    """Drive ``user_turns`` (default: the standard script of ``settings.turns`` turns)
    through the server at ``endpoints`` with ``settings.served_arms``
    (:func:`kakeya_lab.serve.served_long_run.run_served_long_run`) and summarize them.
    ``settings.reprefill_cap_s`` caps the stateless arm's turns. ``model``: the name the
    server must serve (ValueError if it serves another, or if no served arm is asked for)."""
    import httpx

    from kakeya_lab.serve.api_keys import auth_headers
    from kakeya_lab.serve.served_long_run import run_served_long_run

    if not settings.served_arms:
        raise ValueError("run_served: settings.served_arms names no arm")
    turns = settings.user_turns() if user_turns is None else list(user_turns)
    served_model = httpx.get(
        f"{endpoints.http_base}/v1/models", timeout=30, headers=auth_headers()
    ).json()["data"][0]["id"]
    if model is not None and served_model != model:
        raise ValueError(f"the server runs {served_model!r}, not {model!r}")
    cache = server_cache(endpoints.grpc_target)
    table = run_served_long_run(
        endpoints.grpc_target,
        endpoints.http_base,
        turns,
        max_new_tokens=settings.max_new_tokens,
        model=served_model,
        arms=list(settings.served_arms),
        turn_spacing_s=settings.turn_spacing_s,
        duration_s=settings.duration_s,
        stateless_cap_s=settings.reprefill_cap_s,
        log=log,
    )
    summary = summarize_served(
        table,
        cache,
        turns_per_bucket=settings.turns_per_bucket,
        seconds_per_bucket=settings.seconds_per_bucket,
    )
    return ServedRun(table, summary, cache, served_model, endpoints)
