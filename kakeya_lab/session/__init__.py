"""Session runtime: many conversations, one sink-window cache each (docs/design.md, "Sessions").

A module per concept: :mod:`~kakeya_lab.session.errors`, :mod:`~kakeya_lab.session.events`
(every event of a generation stream, and :func:`collect_reply`),
:mod:`~kakeya_lab.session.stream` (:class:`GenerationStream`),
:mod:`~kakeya_lab.session.store` (:class:`SessionStore`: the one session table, its LRU,
idle expiry, claims and metadata), :mod:`~kakeya_lab.session.turn` (the one chat-turn loop)
and :mod:`~kakeya_lab.session.detokenizer` (the one streaming detokenizer). The names below
are the package's public API.
"""

# (isort keeps events before store: kakeya_lab.speculative, which the store uses, imports them)
from kakeya_lab.session.detokenizer import StreamingDetokenizer, text_pieces
from kakeya_lab.session.errors import (
    CapacityExceeded,
    SessionBusy,
    SessionClosed,
    SessionError,
    SessionInUse,
    UnknownSession,
)
from kakeya_lab.session.events import (
    Done,
    Event,
    GenerationCounts,
    GenerationTimings,
    HistoryTruncated,
    Reply,
    SpeculativeStep,
    Token,
    collect_reply,
)
from kakeya_lab.session.records import AppendResult, SessionInfo, SpeculativeSummary
from kakeya_lab.session.store import CapacityPolicy, SessionStore, model_eos_ids
from kakeya_lab.session.stream import GenerationStream
from kakeya_lab.session.turn import ChatTurn, append_message, chat_turn

__all__ = [
    "AppendResult",
    "CapacityExceeded",
    "CapacityPolicy",
    "ChatTurn",
    "Done",
    "Event",
    "GenerationCounts",
    "GenerationStream",
    "GenerationTimings",
    "HistoryTruncated",
    "Reply",
    "SessionBusy",
    "SessionClosed",
    "SessionError",
    "SessionInUse",
    "SessionInfo",
    "SessionStore",
    "SpeculativeStep",
    "SpeculativeSummary",
    "StreamingDetokenizer",
    "Token",
    "UnknownSession",
    "append_message",
    "chat_turn",
    "collect_reply",
    "model_eos_ids",
    "text_pieces",
]
