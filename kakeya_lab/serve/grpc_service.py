"""The gRPC session service (``proto/session.proto``) over :class:`ServedSessions`.

Status mapping (every error leaves other sessions untouched):

==========================================  =====================
unknown, closed or evicted session          ``NOT_FOUND``
bad input (ids, sizes, options, text mode,  ``INVALID_ARGUMENT``
a proposer not loaded, no stop, no chat
template for a text append)
no free slot (reject / queue timeout)       ``RESOURCE_EXHAUSTED``
session busy (stream open, empty session)   ``FAILED_PRECONDITION``
server stopping (queued creations too)     ``UNAVAILABLE``
engine error                                ``INTERNAL``
==========================================  =====================

``Generate`` streams events; when the client cancels, generation stops before the next
token and the session keeps exactly the tokens the server sent (a client may not have
read the last ones still in flight when it cancelled). The session is released before the
stream's last message (``done``) is sent, so a client's next call right after it never
finds the session busy.

Every call is authenticated (:class:`~kakeya_lab.serve.guard.GrpcAuth`: ``UNAUTHENTICATED``
without a valid key) and acts for the key's owner: another owner's session is
``NOT_FOUND``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from kakeya_lab.backends.thread_pool import released
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.serve.admission import AdmissionRejected, ServerShuttingDown
from kakeya_lab.serve.api_keys import ApiKeys
from kakeya_lab.serve.guard import GrpcAuth, grpc_owner
from kakeya_lab.serve.proto import session_pb2 as pb
from kakeya_lab.serve.proto import session_pb2_grpc as pb_grpc
from kakeya_lab.serve.sessions import GenerateOptions, ServedSessions
from kakeya_lab.session import (
    Done,
    HistoryTruncated,
    SessionBusy,
    SessionClosed,
    SessionError,
    SessionInUse,
    SpeculativeStep,
    StreamingDetokenizer,
    Token,
    UnknownSession,
)


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception raised by the serving layer or the store."""
    if isinstance(exc, (UnknownSession, SessionClosed)):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, AdmissionRejected):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (SessionBusy, SessionInUse)):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, ServerShuttingDown):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, ValueError):  # InputTypeError included; a TypeError is a bug
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, SessionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


class SessionService(pb_grpc.SessionServiceServicer):
    """Servicer: each method maps one request onto :class:`ServedSessions`."""

    def __init__(self, served: ServedSessions, keys: ApiKeys | None = None):
        self.served = served
        self.keys = keys if keys is not None else ApiKeys()

    def _fail(self, context: grpc.ServicerContext, exc: BaseException, method: str):
        code = status_of(exc)
        self.served.metrics.errors.labels(code.name).inc()
        message = " ".join(str(exc).split()) or type(exc).__name__
        if code is grpc.StatusCode.INTERNAL:
            message = f"engine error in {method} ({type(exc).__name__}): {message}"
        context.abort(code, message)

    def _call(self, context, method: str, fn: Callable):
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:  # mapped to a status; the server keeps running
            self._fail(context, exc, method)
        finally:
            self.served.metrics.request_latency.labels(f"grpc:{method}").observe(
                time.perf_counter() - t0
            )

    def CreateSession(self, request, context):
        def run():
            system = request.system_prompt if request.HasField("system_prompt") else None
            gone, answered = threading.Event(), threading.Event()

            def ended() -> None:  # the call ended: if before its answer, the client gave up
                if not answered.is_set():
                    gone.set()
                    self.served.admission.released()  # so its queued wait ends now

            context.add_callback(ended)
            try:
                served, queued_s = self.served.create(
                    origin="grpc",
                    system_prompt=system,
                    owner=grpc_owner(self.keys, context),
                    cancelled=gone.is_set,
                )
            finally:
                answered.set()
            if gone.is_set():  # nobody will receive its id: do not leak the session
                self.served.close(served.id)
            return pb.CreateSessionReply(session_id=served.id, queued_s=queued_s)

        return self._call(context, "CreateSession", run)

    def AppendTokens(self, request, context):
        def run():
            owner = grpc_owner(self.keys, context)
            which = request.WhichOneof("input")
            if which == "token_ids":
                ids = list(request.token_ids.ids)
                result = self.served.append_ids(request.session_id, ids, owner)
            elif which in ("user_text", "assistant_text"):
                role = "user" if which == "user_text" else "assistant"
                text = getattr(request, which)
                result = self.served.append_text(request.session_id, role, text, owner)
            else:
                raise ValueError("AppendTokens needs token_ids, user_text or assistant_text")
            return pb.AppendReply(
                appended_tokens=result.appended,
                dropped_tokens=result.dropped,
                latency_s=result.latency_s,
                history_len=result.history_len,
                cache_len=result.cache_len,
            )

        return self._call(context, "AppendTokens", run)

    def Generate(self, request, context) -> Iterator[pb.GenerateEvent]:
        t0 = time.perf_counter()
        stop = threading.Event()
        context.add_callback(stop.set)  # runs when the RPC ends, cancellation included
        try:
            s = request.sampling
            sampling = SamplingConfig(
                temperature=s.temperature,
                top_k=s.top_k if s.HasField("top_k") else None,
                top_p=s.top_p if s.HasField("top_p") else None,
                seed=s.seed if s.HasField("seed") else None,
            )
            options = GenerateOptions(
                max_new_tokens=request.max_new_tokens,
                sampling=sampling,
                stop_token_ids=tuple(request.stop_token_ids),
                proposer=request.proposer or "none",
                draft_length=request.draft_length or 4,
                adaptive_draft_length=request.adaptive_draft_length,
                allow_no_stop=request.allow_no_stop,
            )
            events = self.served.generate(
                request.session_id,
                options,
                cancelled=stop.is_set,
                owner=grpc_owner(self.keys, context),
            )
        except Exception as exc:
            self._fail(context, exc, "Generate")
            return
        # each token's text is what it adds to the reply (special tokens kept): joined, the
        # reply decoded at once, with no half of a multi-byte character in any event
        detok = StreamingDetokenizer.for_tokenizer(self.served.tokenizer, skip_special_tokens=False)
        try:
            for event in events:
                message = self._event(event, detok)
                if isinstance(event, Done):
                    events.close()  # release the session before the client sees the end
                yield message
        except Exception as exc:
            self._fail(context, exc, "Generate")
        finally:
            events.close()
            self.served.metrics.request_latency.labels("grpc:Generate").observe(
                time.perf_counter() - t0
            )

    def _event(self, event, detok: StreamingDetokenizer) -> pb.GenerateEvent:
        if isinstance(event, Token):
            return pb.GenerateEvent(token=pb.TokenEvent(id=event.id, text=detok.add(event.id)))
        if isinstance(event, HistoryTruncated):
            return pb.GenerateEvent(truncated=pb.HistoryTruncatedEvent(dropped=event.dropped))
        if isinstance(event, SpeculativeStep):
            return pb.GenerateEvent(
                step=pb.SpeculativeStepEvent(
                    draft_length=event.draft_length,
                    proposed=event.proposed,
                    accepted=event.accepted,
                    emitted=event.emitted,
                    proposer_s=event.proposer_s,
                    verifier_s=event.verifier_s,
                )
            )
        if isinstance(event, Done):
            c, t = event.counts, event.timings
            return pb.GenerateEvent(
                done=pb.DoneEvent(
                    stop_reason=event.stop_reason,
                    generated_tokens=c.generated_tokens,
                    verifier_forwards=c.verifier_forwards,
                    proposed=c.proposed,
                    accepted=c.accepted,
                    history_len=c.history_len,
                    cache_len=c.cache_len,
                    kv_live_bytes=c.kv_live_bytes,
                    total_s=t.total_s,
                    first_token_s=t.first_token_s or 0.0,
                    tokens_per_s=t.tokens_per_s or 0.0,
                )
            )
        raise TypeError(f"unknown event {type(event).__name__}")

    def GetSessionInfo(self, request, context):
        def run():
            info = self.served.info(request.session_id, grpc_owner(self.keys, context))
            if not request.include_history:
                info["history"] = []
            return pb.SessionInfo(**info)

        return self._call(context, "GetSessionInfo", run)

    def CloseSession(self, request, context):
        def run():
            self.served.close(request.session_id, grpc_owner(self.keys, context))
            return pb.CloseReply()

        return self._call(context, "CloseSession", run)


GRPC_WORKERS = 32  # the server's threads (the admission queue holds fewer: see admission.py)


class RequestThreads(futures.ThreadPoolExecutor):
    """The gRPC server's threads: each lets its OpenMP pool go after every call it served
    (:func:`~kakeya_lab.backends.thread_pool.released`), so the thread computing next (the
    batcher's worker, another call's) runs at full speed."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
        return super().submit(released(fn), *args, **kwargs)


def start_grpc_server(
    served: ServedSessions,
    host: str,
    port: int,
    *,
    max_workers: int = GRPC_WORKERS,
    keys: ApiKeys | None = None,
) -> tuple[grpc.Server, int]:
    """Start the service on ``host:port`` (0: a free port), every call checked against
    ``keys`` (none: open, one anonymous owner); returns the server and its port."""
    keys = keys if keys is not None else ApiKeys()
    auth = GrpcAuth(keys, on_refuse=lambda: served.metrics.errors.labels("UNAUTHENTICATED").inc())
    server = grpc.server(
        RequestThreads(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[auth],
    )
    pb_grpc.add_SessionServiceServicer_to_server(SessionService(served, keys), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port} (in use?)")
    server.start()
    return server, bound
