"""The OpenAI-compatible HTTP endpoint (FastAPI) over :class:`ServedSessions`.

Routes: ``POST /v1/chat/completions`` (``stream`` true: server-sent events), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus), and ``POST /v1/sessions``,
``GET``/``DELETE /v1/sessions/{id}`` for clients that manage sessions explicitly.

Session binding of a chat completion (extension fields, e.g. the ``openai`` client's
``extra_body``): ``session_id`` — continue that session (the messages must extend its
history); otherwise, unless ``reuse`` is false, an open HTTP session whose history is a
prefix of the rendered conversation's token ids is reused, so only the new tokens are
prefilled; ``reuse: false`` is stateless (a fresh session, closed after the reply). The
reply carries ``session_id`` and ``usage.prompt_tokens_details.cached_tokens`` (prompt
tokens not prefilled again), plus a ``kakeya`` object (appended tokens, prefill seconds).

Errors use OpenAI's shape ``{"error": {"message", "type", "code"}}`` with 400 (bad input),
413 (body too large), 404 (unknown session), 409 (session busy), 429 (no free slot), 503 (shutting down) and
500 (engine error). A client that disconnects mid-stream stops generation; its session
keeps exactly the tokens sent. A client that disconnects during a non-streaming request
stops it too (polled every ``DISCONNECT_POLL_S``): generation ends before the next token
and the session keeps the tokens committed until then.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.serve.admission import AdmissionRejected
from kakeya_lab.serve.sessions import (
    Attached,
    GenerateOptions,
    ServedSessions,
    ServerShuttingDown,
    SessionInUse,
    _as_dict,
)
from kakeya_lab.session import (
    Done,
    Event,
    SessionBusy,
    SessionClosed,
    SessionError,
    Token,
    UnknownSession,
)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
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


DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks for a hung-up client


def _status(exc: BaseException) -> tuple[int, str]:
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


def _error_body(exc: BaseException) -> tuple[int, dict]:
    status, kind = _status(exc)
    message = " ".join(str(exc).split()) or type(exc).__name__
    return status, {"error": {"message": message, "type": kind, "code": status}}


def create_app(served: ServedSessions, *, max_body_bytes: int = 8 * 2**20) -> FastAPI:
    """The ASGI app serving ``served`` (see the module docstring); request bodies larger
    than ``max_body_bytes`` are refused with 413."""
    app = FastAPI(title="kakeya_lab", docs_url=None, redoc_url=None)
    metrics = served.metrics
    tok = served.tokenizer

    def fail(exc: BaseException) -> JSONResponse:
        status, body = _error_body(exc)
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return fail(ValueError(f"invalid request: {where}: {first.get('msg', exc)}"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if served.shutting_down.is_set():
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse(
            {"status": "ok", "model": served.model_name, "sessions": len(served.store)}
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await run_in_threadpool(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {"id": served.model_name, "object": "model", "created": 0, "owned_by": "kakeya_lab"}
            ],
        }

    @app.post("/v1/sessions")
    async def create_session() -> JSONResponse:
        try:
            session, queued_s = await run_in_threadpool(served.create, origin="http")
        except Exception as exc:
            return fail(exc)
        return JSONResponse({"session_id": session.id, "queued_s": queued_s})

    @app.get("/v1/sessions/{session_id}")
    async def session_info(session_id: str) -> JSONResponse:
        try:
            return JSONResponse(await run_in_threadpool(served.info, session_id))
        except Exception as exc:
            return fail(exc)

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str) -> JSONResponse:
        try:
            await run_in_threadpool(served.close, session_id)
        except Exception as exc:
            return fail(exc)
        return JSONResponse({"session_id": session_id, "closed": True})

    def options_of(req: ChatCompletionRequest) -> GenerateOptions:
        if req.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {req.n}")
        if req.stop:
            raise ValueError(
                "stop strings are not supported: pass stop_token_ids (an extension field)"
            )
        max_new = req.max_completion_tokens or req.max_tokens or 256
        temperature = 0.0 if req.temperature is None else req.temperature
        sampling = SamplingConfig(
            temperature=temperature,
            top_k=req.top_k if temperature > 0 else None,
            top_p=req.top_p if temperature > 0 and req.top_p is not None else None,
            seed=req.seed,
        )
        options = GenerateOptions(
            max_new_tokens=max_new,
            sampling=sampling,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            proposer=req.proposer,
            draft_length=req.draft_length,
        )
        served.check_options(options)
        if req.model not in (None, "", served.model_name):
            raise ValueError(
                f"model {req.model!r} is not served here; this server serves {served.model_name!r}"
            )
        return options

    def prepare(req: ChatCompletionRequest) -> tuple[GenerateOptions, Attached]:
        options = options_of(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt_ids = served.render_ids(messages)
        return options, served.attach(prompt_ids, session_id=req.session_id, reuse=req.reuse)

    def extension(att: Attached) -> dict:
        appended = att.appended
        return {
            "session_id": att.session.id,
            "reused_tokens": att.reused_tokens,
            "appended_tokens": appended.appended if appended else 0,
            "prefill_s": appended.latency_s if appended else 0.0,
            "history_len": appended.history_len if appended else att.reused_tokens,
            "queued_s": att.queued_s,
        }

    def usage(att: Attached, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": att.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": att.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": att.reused_tokens},
        }

    def finish_reason(done: Done | None) -> str:
        return "length" if done is None or done.stop_reason == "max_tokens" else "stop"

    def text_of(ids: list[int]) -> str:
        return tok.decode(
            [t for t in ids if t not in served.store.eos_token_ids], skip_special_tokens=True
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        t0 = time.perf_counter()
        try:
            options, att = await run_in_threadpool(prepare, req)
        except Exception as exc:
            return fail(exc)
        stateless = not req.reuse and req.session_id is None
        created = int(time.time())
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        ext = extension(att)
        base = {
            "id": cid,
            "created": created,
            "model": served.model_name,
            "session_id": att.session.id,
        }

        if not req.stream:
            gone = threading.Event()  # the client disconnected, or the reply is ready

            def run() -> tuple[list[int], Done | None]:
                ids: list[int] = []
                done = None
                for event in served.generate(att.session.id, options, cancelled=gone.is_set):
                    if isinstance(event, Token):
                        ids.append(event.id)
                    elif isinstance(event, Done):
                        done = event
                return ids, done

            async def watch_disconnect() -> None:
                # no stream to fail on: poll, so a client that hangs up stops generation
                # before the next token (the session keeps the tokens committed so far)
                while not gone.is_set():
                    if await request.is_disconnected():
                        gone.set()
                        return
                    await anyio.sleep(DISCONNECT_POLL_S)

            watcher = asyncio.ensure_future(watch_disconnect())
            try:
                ids, done = await run_in_threadpool(run)
            except Exception as exc:
                return fail(exc)
            finally:
                gone.set()
                watcher.cancel()
                served.detach(att.session, close=stateless)
                metrics.request_latency.labels("http:chat").observe(time.perf_counter() - t0)
            ext["generation"] = (
                {"counts": _as_dict(done.counts), "timings": _as_dict(done.timings)}
                if done
                else None
            )
            return JSONResponse(
                {
                    **base,
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": finish_reason(done),
                            "message": {"role": "assistant", "content": text_of(ids)},
                        }
                    ],
                    "usage": usage(att, len(ids)),
                    "kakeya": ext,
                }
            )

        cancel = threading.Event()  # the client left: stop before the next token
        try:
            events = await run_in_threadpool(
                served.generate, att.session.id, options, cancel.is_set
            )
        except Exception as exc:
            served.detach(att.session, close=stateless)
            return fail(exc)

        async def sse() -> AsyncIterator[str]:
            def chunk(delta: dict, finish: str | None = None, **more) -> str:
                body = {
                    **base,
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    **more,
                }
                return f"data: {json.dumps(body)}\n\n"

            loop = asyncio.get_running_loop()
            queue: asyncio.Queue[Event | _StreamEnd] = asyncio.Queue()
            # One engine thread per stream pulls the events and hands each to the event loop.
            # It pulls the next event only once the previous one has been handed to the
            # transport (one credit), so a client that leaves takes with it the session's
            # every delivered token and nothing more; ``cancel`` stops it before the next.
            credit = threading.Semaphore(1)
            producer = threading.Thread(
                target=_produce,
                args=(events, loop, queue, credit, cancel),
                name="sse-stream",
                daemon=True,
            )
            detok = _Detokenizer(text_of)
            n_tokens = 0
            done = None
            try:
                yield chunk({"role": "assistant", "content": ""})
                producer.start()
                while True:
                    event = await queue.get()
                    if isinstance(event, _StreamEnd):
                        if event.error is not None:
                            raise event.error
                        break
                    if isinstance(event, Token):
                        n_tokens += 1
                        delta = detok.add(event.id)
                        if delta:
                            yield chunk({"content": delta})
                    elif isinstance(event, Done):
                        done = event
                    credit.release()  # handed on: the engine may pull the next event
                ext["generation"] = (
                    {"counts": _as_dict(done.counts), "timings": _as_dict(done.timings)}
                    if done
                    else None
                )
                yield chunk({}, finish_reason(done), usage=usage(att, n_tokens), kakeya=ext)
                yield "data: [DONE]\n\n"
            except Exception as exc:  # headers are sent: report in-band, then end the stream
                status, body = _error_body(exc)
                metrics.errors.labels(str(status)).inc()
                yield f"data: {json.dumps(body)}\n\n"
            finally:
                cancel.set()
                credit.release()  # a producer waiting for credit sees ``cancel`` and ends
                with anyio.CancelScope(
                    shield=True
                ):  # also on disconnect: keep exactly what was sent
                    if producer.is_alive():
                        await anyio.to_thread.run_sync(producer.join)
                    else:
                        await anyio.to_thread.run_sync(events.close)  # never started
                    await anyio.to_thread.run_sync(
                        lambda: served.detach(att.session, close=stateless)
                    )
                metrics.request_latency.labels("http:chat_stream").observe(time.perf_counter() - t0)

        return StreamingResponse(sse(), media_type="text/event-stream")

    app.add_middleware(
        BodyLimit,
        max_body_bytes=max_body_bytes,
        on_refuse=lambda: metrics.errors.labels("413").inc(),
    )
    return app


@dataclass(frozen=True)
class _StreamEnd:
    """The engine thread's last item: the stream ended (``error``: how, if it failed)."""

    error: BaseException | None = None


def _produce(
    events: Iterator[Event],
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue,
    credit: threading.Semaphore,
    cancel: threading.Event,
) -> None:
    """Run in a stream's engine thread: pull each event once ``credit`` allows (the
    consumer releases it after handing the previous one on) and hand it to ``queue`` on
    ``loop``, until the stream ends or ``cancel`` is set; then a :class:`_StreamEnd`. The
    generator is closed here, in the thread that ran it."""

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (the server stopped): nobody listens
            pass

    end = _StreamEnd()
    it = iter(events)
    try:
        while True:
            credit.acquire()
            if cancel.is_set():
                break
            try:
                event = next(it)
            except StopIteration:
                break
            put(event)
    except Exception as exc:
        end = _StreamEnd(exc)
    finally:
        try:
            close = getattr(events, "close", None)
            if close is not None:
                close()
        finally:
            put(end)


class _Detokenizer:
    """The text of a growing reply, delta by delta: each token re-decodes only the tokens
    since the text last grew (plus the token before them, so a tokenizer that strips a
    leading space does it to both decodes alike), not the whole reply: O(n) for n tokens.
    Text ending in an incomplete UTF-8 sequence waits for the next token."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # the window's start
        self.read = 0  # tokens whose text has been returned

    def add(self, token_id: int) -> str:
        """Append ``token_id``; the new text it completes ("" if none yet)."""
        self.ids.append(token_id)
        shown = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(shown):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown) :]


class BodyLimit:
    """Pure ASGI middleware: refuse a request whose Content-Length exceeds ``max_body_bytes``
    with 413 (a pure ASGI layer keeps streaming responses and disconnects untouched)."""

    def __init__(self, app, *, max_body_bytes: int, on_refuse=lambda: None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_body_bytes:
                self.on_refuse()
                body = {
                    "error": {
                        "message": f"request body of {int(length)} bytes is larger than this server's limit "
                        f"{self.max_body_bytes}: send a shorter conversation (or continue a session)",
                        "type": "request_too_large",
                        "code": 413,
                    }
                }
                await JSONResponse(body, status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)
