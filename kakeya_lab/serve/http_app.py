"""The OpenAI-compatible HTTP endpoint (FastAPI) over :class:`ServedSessions`: the routes.

Routes: ``POST /v1/chat/completions`` (``stream`` true: server-sent events), ``GET
/v1/models``, ``GET /v1/models/{id}``, ``GET /v1/proposers`` (what a request may name in its
``proposer`` field: the registry's model-free kinds and the draft models the server loaded
with ``--draft``), ``GET /health``, ``GET /metrics`` (Prometheus), and ``POST /v1/sessions``,
``GET``/``DELETE /v1/sessions/{id}`` for clients that manage sessions explicitly. The wire
format is :mod:`kakeya_lab.serve.openai_protocol`; the work is
:mod:`kakeya_lab.serve.http_handlers`.

Session binding of a chat completion (extension fields, e.g. the ``openai`` client's
``extra_body``): ``session_id`` — continue that session (the messages must extend its
history); otherwise, unless ``reuse`` is false, an idle implicit session of the same caller
(API key) whose history is a prefix of the rendered conversation's token ids is reused, so
only the new tokens are prefilled; ``reuse: false`` is stateless (a fresh session, closed after the reply). The
reply carries ``session_id`` and ``usage.prompt_tokens_details.cached_tokens`` (prompt
tokens not prefilled again), plus a ``kakeya`` object (appended tokens, prefill seconds).

Every error, whatever raised it (validation, unparseable JSON, unknown route or model,
wrong method, body too large, session errors, engine errors), is an OpenAI error object
``{"error": {"message", "type", "param", "code"}}``: 400 (bad input), 404 (unknown
route, model or session), 405 (method not allowed), 413 (body too large, enforced while
the body is read, chunked bodies included), 409 (session busy), 429 (no free slot), 503
(shutting down) and 500 (engine error).
"""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kakeya_lab.backends.thread_pool import released
from kakeya_lab.serve import http_handlers
from kakeya_lab.serve.api_keys import ApiKeys
from kakeya_lab.serve.guard import HostCheck, HttpGuard, owner_of
from kakeya_lab.serve.openai_protocol import (
    ChatCompletionRequest,
    ModelNotFound,
    error_body,
    error_object,
)
from kakeya_lab.serve.sessions import ServedSessions


def create_app(
    served: ServedSessions,
    *,
    max_body_bytes: int = 8 * 2**20,
    keys: ApiKeys | None = None,
    hosts: HostCheck | None = None,
    allowed_origins: tuple[str, ...] = (),
) -> FastAPI:
    """The ASGI app serving ``served`` (see the module docstring); request bodies larger
    than ``max_body_bytes`` are refused with 413; every request passes
    :class:`~kakeya_lab.serve.guard.HttpGuard` (``keys``, ``hosts``, ``allowed_origins``)."""
    app = FastAPI(title="kakeya_lab", docs_url=None, redoc_url=None)
    metrics = served.metrics

    def fail(exc: BaseException) -> JSONResponse:
        status, body = error_body(exc)
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg', exc)}"
        else:
            message = f"invalid request: {where}: {first.get('msg', exc)}"
        metrics.errors.labels("400").inc()
        return JSONResponse(
            error_object(400, "invalid_request_error", message, where or None), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = (
                f"no route {request.url.path!r} (see GET /v1/models, POST /v1/chat/completions)"
            )
            kind = "not_found"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path!r}"
            kind = "method_not_allowed"
        else:
            message, kind = str(exc.detail), "invalid_request_error"
        metrics.errors.labels(str(status)).inc()
        return JSONResponse(
            error_object(status, kind, message), status_code=status, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        metrics.errors.labels("500").inc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        return JSONResponse(
            error_object(500, "internal_error", f"internal error: {message}"), status_code=500
        )

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

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != served.model_name:
            return fail(
                ModelNotFound(
                    f"model {model_id!r} is not served here; this server serves "
                    f"{served.model_name!r}"
                )
            )
        return JSONResponse(
            {"id": served.model_name, "object": "model", "created": 0, "owned_by": "kakeya_lab"}
        )

    @app.get("/v1/proposers")
    async def proposers() -> dict:
        return {"object": "list", "data": served.proposers.listing()}

    @app.post("/v1/sessions")
    async def create_session(request: Request) -> JSONResponse:
        try:
            session, queued_s = await run_in_threadpool(
                released(served.create), origin="http", owner=owner_of(request)
            )
        except Exception as exc:
            return fail(exc)
        return JSONResponse({"session_id": session.id, "queued_s": queued_s})

    @app.get("/v1/sessions/{session_id}")
    async def session_info(session_id: str, request: Request) -> JSONResponse:
        try:
            return JSONResponse(await run_in_threadpool(served.info, session_id, owner_of(request)))
        except Exception as exc:
            return fail(exc)

    @app.delete("/v1/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> JSONResponse:
        try:
            await run_in_threadpool(served.close, session_id, owner_of(request))
        except Exception as exc:
            return fail(exc)
        return JSONResponse({"session_id": session_id, "closed": True})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        t0 = time.perf_counter()
        try:
            options, att = await run_in_threadpool(
                released(http_handlers.prepare), served, req, owner_of(request)
            )
        except Exception as exc:
            return fail(exc)
        if not req.stream:
            try:
                body = await http_handlers.complete(served, req, att, options, request, t0)
            except Exception as exc:
                return fail(exc)
            return JSONResponse(body)
        cancel = threading.Event()  # the client left: stop before the next token
        try:
            events = await run_in_threadpool(
                released(served.generate), att.session.id, options, cancel.is_set
            )
        except Exception as exc:
            served.detach(att.session, close=http_handlers.stateless(req))
            return fail(exc)
        chunks = http_handlers.stream_chunks(
            served, req, att, events, cancel, request.is_disconnected, t0
        )
        return StreamingResponse(chunks, media_type="text/event-stream")

    app.add_middleware(
        BodyLimit,
        max_body_bytes=max_body_bytes,
        on_refuse=lambda: metrics.errors.labels("413").inc(),
    )
    app.add_middleware(  # outermost: refuses before anything else runs
        HttpGuard,
        keys=keys if keys is not None else ApiKeys(),
        hosts=hosts if hosts is not None else HostCheck("127.0.0.1"),
        allowed_origins=allowed_origins,
        on_refuse=lambda status: metrics.errors.labels(str(status)).inc(),
    )
    return app


DRAIN_FACTOR = 4  # after a refusal, read (and drop) at most this many limits more


class BodyLimit:
    """Pure ASGI middleware: refuse a request body larger than ``max_body_bytes`` with 413
    (a pure ASGI layer keeps streaming responses and disconnects untouched).

    A Content-Length over the limit is refused before reading; any other body (chunked
    transfer included) is counted while it is read and refused as soon as it passes the
    limit, so at most ``max_body_bytes`` is ever held. After a refusal the rest of the
    body is read and dropped (up to ``DRAIN_FACTOR`` limits more, then the connection is
    closed), so the client reads the 413 instead of a reset connection.
    """

    def __init__(self, app, *, max_body_bytes: int, on_refuse=lambda: None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await self.refuse(scope, receive, send, f"request body of {int(length)} bytes")
            return
        parts: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                parts.clear()
                await self.drain(receive, more)
                await self.refuse(scope, receive, send, "request body")
                return
            parts.append(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(parts), "more_body": False}

        await self.app(scope, replay, send)

    async def drain(self, receive, more: bool) -> None:
        """Read and drop the rest of a refused body (bounded)."""
        dropped = 0
        while more and dropped <= DRAIN_FACTOR * self.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            more = message.get("more_body", False)

    async def refuse(self, scope, receive, send, what: str) -> None:
        self.on_refuse()
        body = error_object(
            413,
            "request_too_large",
            f"{what} is larger than this server's limit of {self.max_body_bytes} bytes: "
            "send a shorter conversation (or continue a session)",
        )
        await JSONResponse(body, status_code=413)(scope, receive, send)
