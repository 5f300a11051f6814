"""Concurrent load against a running server: N sessions x M turns through the gRPC client.

:func:`load_conversations` makes deterministic token-id conversations; :func:`run_load`
drives them at once (one thread and one channel per session; each turn appends the turn's
ids and streams a greedy reply) and returns every reply with per-turn latencies;
:func:`latency_summary` gives throughput and p50/p95/p99. ``benchmarks/serve_load.py``
prints them; ``tests/test_serve_load.py`` checks the replies against a sequential
in-process run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LoadResult:
    """``replies[s][t]``: session ``s``'s reply ids at turn ``t``; ``turn_s[s][t]``: that
    turn's client-side seconds (append + generate); ``wall_s``: the whole load."""

    replies: list[list[list[int]]]
    turn_s: list[list[float]]
    wall_s: float


def load_conversations(
    sessions: int,
    turns: int,
    *,
    tokens_per_turn: int = 6,
    vocab: tuple[int, int] = (200, 30000),
    seed: int = 0,
) -> list[list[list[int]]]:
    """``sessions`` conversations of ``turns`` user turns, each ``tokens_per_turn`` ids drawn
    uniformly from ``vocab`` (deterministic for ``seed``)."""
    rng = np.random.default_rng(seed)
    low, high = vocab
    return [
        [rng.integers(low, high, tokens_per_turn).tolist() for _ in range(turns)]
        for _ in range(sessions)
    ]


def run_load(
    grpc_target: str, conversations: Sequence[Sequence[Sequence[int]]], max_new_tokens: int
) -> LoadResult:
    """Every conversation in its own session, all at once; sessions are closed at the end
    (also on error)."""
    from kakeya_lab.serve.client import SessionClient

    def one(turns: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[float]]:
        replies, times = [], []
        with SessionClient(grpc_target, timeout_s=600) as client:
            sid = client.create()
            try:
                for ids in turns:
                    t = time.perf_counter()
                    client.append_ids(sid, ids)
                    replies.append(client.generate(sid, max_new_tokens).token_ids)
                    times.append(time.perf_counter() - t)
            finally:
                client.close_session(sid)
        return replies, times

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(conversations))) as pool:
        results = list(pool.map(one, conversations))
    wall = time.perf_counter() - t0
    return LoadResult([r for r, _ in results], [t for _, t in results], wall)


def latency_summary(result: LoadResult) -> dict[str, float]:
    """Turns and generated tokens per second over the whole load, and per-turn latency
    percentiles (seconds)."""
    times = np.array([t for session in result.turn_s for t in session], dtype=float)
    tokens = sum(len(r) for session in result.replies for r in session)
    p50, p95, p99 = np.percentile(times, [50, 95, 99]) if len(times) else (np.nan,) * 3
    return {
        "sessions": len(result.replies),
        "turns": int(len(times)),
        "generated_tokens": int(tokens),
        "wall_s": result.wall_s,
        "turns_per_s": len(times) / result.wall_s,
        "tokens_per_s": tokens / result.wall_s,
        "turn_p50_s": float(p50),
        "turn_p95_s": float(p95),
        "turn_p99_s": float(p99),
    }
