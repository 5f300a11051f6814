"""The OpenAI chat-completions wire format this server speaks (pydantic request models, the
response and error bodies).

Requests: :class:`ChatCompletionRequest` with the extension fields ``session_id``,
``reuse``, ``top_k``, ``stop_token_ids``, ``proposer`` and ``draft_length`` (e.g. the
``openai`` client's ``extra_body``). Errors use OpenAI's shape
``{"error": {"message", "type", "code"}}`` with the statuses of :func:`status_of`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kakeya_lab.serve.admission import AdmissionRejected
from kakeya_lab.serve.sessions import Attached, ServerShuttingDown
from kakeya_lab.session import (
    Done,
    SessionBusy,
    SessionClosed,
    SessionError,
    SessionInUse,
    UnknownSession,
)


class ChatMessage(BaseModel):
    """One message; ``content`` is a string or a list of text parts."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The message's text (text parts joined); other part types are refused."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    "only text content parts are supported ({'type': 'text', 'text': ...})"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    # extensions
    session_id: str | None = None
    reuse: bool = True
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    proposer: str = "none"
    draft_length: int = 4


def status_of(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and OpenAI error type for an exception of the serving layer."""
    if isinstance(exc, (UnknownSession, SessionClosed)):
        return 404, "not_found"
    if isinstance(exc, AdmissionRejected):
        return 429, "capacity_exhausted"
    if isinstance(exc, (SessionBusy, SessionInUse)):
        return 409, "session_busy"
    if isinstance(exc, ServerShuttingDown):
        return 503, "shutting_down"
    if isinstance(exc, ValueError):  # InputTypeError included; a TypeError is a bug
        return 400, "invalid_request_error"
    if isinstance(exc, SessionError):
        return 409, "session_state"
    return 500, "engine_error"


def error_body(exc: BaseException) -> tuple[int, dict]:
    """The status and OpenAI-shaped error body for ``exc``."""
    status, kind = status_of(exc)
    message = " ".join(str(exc).split()) or type(exc).__name__
    return status, {"error": {"message": message, "type": kind, "code": status}}


def finish_reason(done: Done | None) -> str:
    """``length`` when the reply hit its token limit (or was cut short), else ``stop``."""
    return "length" if done is None or done.stop_reason == "max_tokens" else "stop"


def usage(att: Attached, completion_tokens: int) -> dict:
    """The ``usage`` object; ``cached_tokens`` are the prompt tokens not prefilled again."""
    return {
        "prompt_tokens": att.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": att.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": att.reused_tokens},
    }


def extension(att: Attached, done: Done | None) -> dict:
    """The ``kakeya`` object: the session binding, its prefill and the generation figures."""
    appended = att.appended
    return {
        "session_id": att.session.id,
        "reused_tokens": att.reused_tokens,
        "appended_tokens": appended.appended if appended else 0,
        "prefill_s": appended.latency_s if appended else 0.0,
        "history_len": appended.history_len if appended else att.reused_tokens,
        "queued_s": att.queued_s,
        "generation": (
            {"counts": done.counts.to_dict(), "timings": done.timings.to_dict()} if done else None
        ),
    }


def completion_body(base: dict, att: Attached, text: str, n_tokens: int, done: Done | None) -> dict:
    """A non-streaming ``chat.completion``; ``base`` holds id, created, model, session_id."""
    return {
        **base,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason(done),
                "message": {"role": "assistant", "content": text},
            }
        ],
        "usage": usage(att, n_tokens),
        "kakeya": extension(att, done),
    }


def chunk_body(base: dict, delta: dict, finish: str | None = None, **more) -> dict:
    """One ``chat.completion.chunk`` of a stream."""
    return {
        **base,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **more,
    }
