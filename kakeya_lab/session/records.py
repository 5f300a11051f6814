"""What the store reports about a session: an append's result, a session's info and its
cumulative speculative figures (docs/design.md, "Metrics")."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AppendResult:
    appended: int
    dropped: int
    latency_s: float
    history_len: int
    cache_len: int


@dataclass(frozen=True)
class SessionInfo:
    id: str
    history_len: int
    cache_len: int
    kv_live_bytes: int
    turns: int
    generated_tokens: int
    created_s: float
    last_used_s: float
    config: dict
    speculative: SpeculativeSummary

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SpeculativeSummary:
    """Cumulative speculative figures of a session (docs/design.md, "Metrics"):
    ``acceptance_rate`` = accepted / proposed, ``tau`` = tokens per verifier forward of its
    speculative generations (None when not measured)."""

    steps: int
    proposed: int
    accepted: int
    acceptance_rate: float | None
    tau: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def speculative_summary(stats: dict) -> SpeculativeSummary:
    """Cumulative speculative figures of a session (docs/design.md, "Metrics")."""
    proposed, accepted = stats.get("proposed", 0), stats.get("accepted", 0)
    return SpeculativeSummary(
        steps=stats.get("steps", 0),
        proposed=proposed,
        accepted=accepted,
        acceptance_rate=accepted / proposed if proposed else None,
        tau=stats["emitted"] / stats["forwards"] if stats.get("forwards") else None,
    )
