"""One row of the per-turn table of a long run, and the checks that refuse a meaningless run."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass


class DegenerateRun(RuntimeError):
    """A run whose numbers would be meaningless (``kv_live_bytes`` zero, no successful turn)."""


@dataclass
class TurnRecord:
    """What the recorder keeps of one turn of one arm (units in the names)."""

    arm: str
    turn: int
    user_tokens: int
    append_latency_s: float
    first_token_s: float | None
    generate_s: float
    decode_s_per_token: float | None
    generated_tokens: int
    stop_reason: str
    kv_live_bytes: int
    cache_len: int
    history_len: int
    rss_bytes: int
    truncated: bool
    dropped_total: int
    wall_s: float
    repetition: float
    reply: str
    probe_recalled: bool | None = None
    probe_distance_tokens: int | None = None
    probe_reply: str | None = None
    error: str | None = None
    proposed: int = 0  # draft tokens proposed (speculative arm)
    accepted: int = 0  # of which the verifier accepted
    tau: float | None = None  # tokens per verifier forward
    proposer_s: float = 0.0
    reply_ids_sha256: str | None = None  # :func:`ids_digest` of the reply's token ids


def ids_digest(token_ids: Sequence[int]) -> str:
    """A short stable digest of a list of token ids (equal lists, equal digests)."""
    return hashlib.sha256(json.dumps([int(t) for t in token_ids]).encode()).hexdigest()[:16]


def refuse_degenerate(rows: list[dict]) -> None:
    """Raise :class:`DegenerateRun` if any successful turn held zero KV bytes."""
    ok = [r for r in rows if not r.get("error")]
    zero = [r for r in ok if r.get("kv_live_bytes", 0) <= 0]
    if zero:
        raise DegenerateRun(
            f"kv_live_bytes is zero on {len(zero)} turn(s) (first: arm {zero[0]['arm']}, turn {zero[0]['turn']}): "
            "a bug, not a result"
        )


def refuse_all_failed(rows: list[dict]) -> None:
    """Raise :class:`DegenerateRun` if there are turns and every one of them failed."""
    if rows and all(r.get("error") for r in rows):
        first = rows[0]
        raise DegenerateRun(
            f"every turn failed ({len(rows)} of {len(rows)}); first: arm {first['arm']}, "
            f"{first['error']}"
        )
