"""The OpenAI-compatible HTTP endpoint (FastAPI) over :class:`ServedSessions`: the routes.

Routes: ``POST /v1/chat/completions`` (``stream`` true: server-sent events), ``GET
/v1/models``, ``GET /v1/proposers`` (the proposer kinds a request may name in its
``proposer`` field: the registry's model-free ones), ``GET /health``, ``GET /metrics`` (Prometheus), and ``POST /v1/sessions``,
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

Errors: 400 (bad input), 413 (body too large), 404 (unknown session), 409 (session busy),
429 (no free slot), 503 (shutting down) and 500 (engine error).
"""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from kakeya_lab.serve import http_handlers
from kakeya_lab.serve.api_keys import ApiKeys
from kakeya_lab.serve.guard import HostCheck, HttpGuard, owner_of
from kakeya_lab.serve.openai_protocol import ChatCompletionRequest, error_body
from kakeya_lab.serve.sessions import ServedSessions, served_proposer_kinds


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

    @app.get("/v1/proposers")
    async def proposers() -> dict:
        return {
            "object": "list",
            "data": [
                {"id": k.name, "usage": k.usage, "summary": k.summary, "tree": k.tree}
                for k in served_proposer_kinds()
            ],
        }

    @app.post("/v1/sessions")
    async def create_session(request: Request) -> JSONResponse:
        try:
            session, queued_s = await run_in_threadpool(
                served.create, origin="http", owner=owner_of(request)
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
                http_handlers.prepare, served, req, owner_of(request)
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
                served.generate, att.session.id, options, cancel.is_set
            )
        except Exception as exc:
            served.detach(att.session, close=http_handlers.stateless(req))
            return fail(exc)
        chunks = http_handlers.stream_chunks(served, req, att, events, cancel, t0)
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
