"""The events of a generation stream, and a stream collected into a :class:`Reply`.

:meth:`~kakeya_lab.session.SessionStore.generate` yields at most one
:class:`HistoryTruncated`, one :class:`Token` per delivered token, a
:class:`SpeculativeStep` per verifier forward in speculative mode (the
:class:`~kakeya_lab.speculative.Decoder` makes them), and a final :class:`Done`. This module
is a leaf (no torch, no other kakeya_lab module), so the decoder and every consumer
(serve, widgets, bench) share the one definition.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kakeya_lab.session.errors import SessionError


@dataclass(frozen=True)
class HistoryTruncated:
    """The cache has started dropping history: ``dropped`` tokens are no longer attended
    once the next :class:`Token` is delivered."""

    dropped: int


@dataclass(frozen=True)
class Token:
    """One delivered token; the session has committed it."""

    id: int


@dataclass(frozen=True)
class SpeculativeStep:
    """One verifier forward: ``proposed`` drafts (asked: ``draft_length``), ``accepted`` of
    them, ``emitted`` tokens offered to the consumer. ``tree``: a draft tree was verified
    (``proposed`` its nodes, ``draft_length`` the node budget, ``accepted`` the path's length)."""

    draft_length: int
    proposed: int
    accepted: int
    emitted: int
    proposer_s: float
    verifier_s: float
    tree: bool = False


@dataclass(frozen=True)
class GenerationCounts:
    """What one ``generate`` call did. ``tau`` is tokens per verifier forward (1.0 for
    plain decoding; None without a forward); history and cache figures are after the call."""

    generated_tokens: int
    verifier_forwards: int
    tau: float | None
    proposed: int
    accepted: int
    history_len: int
    cache_len: int
    kv_live_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GenerationTimings:
    """Wall-clock seconds of one ``generate`` call (``first_token_s`` from the first
    ``next()``; None if no token was delivered)."""

    total_s: float
    first_token_s: float | None
    verifier_s: float
    proposer_s: float
    tokens_per_s: float | None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Done:
    """End of a ``generate`` call. ``stop_reason`` is ``"eos"``, ``"stop"`` or ``"max_tokens"``."""

    stop_reason: str
    counts: GenerationCounts
    timings: GenerationTimings


Event = HistoryTruncated | Token | SpeculativeStep | Done


@dataclass(frozen=True)
class Reply:
    """A generate stream collected: the delivered ``token_ids``, the final :class:`Done`,
    ``truncated_dropped`` (the :class:`HistoryTruncated` figure, None if none came) and the
    speculative ``steps`` in order."""

    token_ids: list[int]
    done: Done
    truncated_dropped: int | None
    steps: list[SpeculativeStep]


def collect_reply(events: Iterable[Event]) -> Reply:
    """Consume a ``generate`` stream to its end and collect it into a :class:`Reply`.

    Raises :class:`SessionError` if the stream ends without a :class:`Done` (it was closed
    part-way)."""
    token_ids: list[int] = []
    steps: list[SpeculativeStep] = []
    truncated = None
    done = None
    for event in events:
        if isinstance(event, Token):
            token_ids.append(event.id)
        elif isinstance(event, HistoryTruncated):
            truncated = event.dropped
        elif isinstance(event, SpeculativeStep):
            steps.append(event)
        elif isinstance(event, Done):
            done = event
    if done is None:
        raise SessionError("the stream ended without a Done event (it was closed part-way)")
    return Reply(token_ids=token_ids, done=done, truncated_dropped=truncated, steps=steps)
