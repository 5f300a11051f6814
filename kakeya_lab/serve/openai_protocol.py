"""The OpenAI chat-completions wire format this server speaks (pydantic request models, the
response and error bodies).

Requests: :class:`ChatCompletionRequest` with the extension fields ``session_id``,
``reuse``, ``top_k``, ``stop_token_ids``, ``proposer`` (a model-free spec or a draft model
the server loaded), ``draft_length`` and ``allow_no_stop`` (e.g. the
``openai`` client's ``extra_body``). OpenAI fields this server does not implement
(:data:`UNSUPPORTED`) are refused with 400, never silently ignored. Errors use OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}`` (``code``: the HTTP status) with
the statuses of :func:`status_of`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kakeya_lab.serve.admission import AdmissionRejected, ServerShuttingDown
from kakeya_lab.serve.sessions import Attached
from kakeya_lab.session import (
    Done,
    SessionBusy,
    SessionClosed,
    SessionError,
    SessionInUse,
    UnknownSession,
)

MAX_STOP_STRINGS = 4  # OpenAI's limit

# OpenAI request fields this server does not implement: refused with 400 when set
# (``response_format`` only when it asks for more than plain text).
UNSUPPORTED = {
    "logprobs": "log probabilities are not returned by this server",
    "top_logprobs": "log probabilities are not returned by this server",
    "tools": "tool calls are not supported",
    "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "response_format": "only plain text replies are supported (response_format type 'text')",
}


class InvalidParam(ValueError):
    """A request field with a value this server refuses (400); ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class ModelNotFound(LookupError):
    """A request names a model this server does not serve (404)."""

    param = "model"


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
    # OpenAI fields that are refused when set (see UNSUPPORTED)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    # extensions
    session_id: str | None = None
    reuse: bool = True
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    proposer: str = "none"
    draft_length: int = 4
    allow_no_stop: bool = False

    def refuse_unsupported(self) -> None:
        """:class:`InvalidParam` for the first OpenAI field this server does not implement."""
        for name, why in UNSUPPORTED.items():
            value = getattr(self, name)
            if value is None or value is False:
                continue
            if name == "response_format" and value.get("type", "text") == "text":
                continue
            raise InvalidParam(name, f"{name} is not supported: {why}; leave it out")
        if self.n != 1:
            raise InvalidParam("n", f"n must be 1 (one choice per request), got {self.n}")

    def stop_strings(self) -> list[str]:
        """The ``stop`` field as a list (at most :data:`MAX_STOP_STRINGS` non-empty strings)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidParam(
                "stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}"
            )
        if any(not s for s in stops):
            raise InvalidParam("stop", "stop strings must be non-empty")
        return stops

    def max_new_tokens(self) -> int:
        """``max_completion_tokens``, else ``max_tokens``, else 256 (0 is refused later)."""
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None:
                if value < 1:
                    raise InvalidParam(name, f"{name} must be at least 1, got {value}")
                return value
        return 256


def status_of(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and OpenAI error type for an exception of the serving layer."""
    if isinstance(exc, ModelNotFound):
        return 404, "model_not_found"
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
    """The status and OpenAI-shaped error body for ``exc`` (``param``: the field at fault,
    when the exception names one)."""
    status, kind = status_of(exc)
    message = " ".join(str(exc).split()) or type(exc).__name__
    return status, error_object(status, kind, message, getattr(exc, "param", None))


def error_object(status: int, kind: str, message: str, param: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def finish_reason(done: Done | None, stopped: bool = False) -> str:
    """``stop`` when a stop string ended the reply (``stopped``) or the model stopped;
    ``length`` when it hit its token limit (or was cut short)."""
    if stopped:
        return "stop"
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


def completion_body(
    base: dict, att: Attached, text: str, n_tokens: int, done: Done | None, stopped: bool = False
) -> dict:
    """A non-streaming ``chat.completion``; ``base`` holds id, created, model, session_id;
    ``stopped``: a stop string ended the reply."""
    return {
        **base,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason(done, stopped),
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
