"""The work behind the HTTP routes: a chat completion on :class:`ServedSessions`, whole or
streamed as server-sent events (:mod:`kakeya_lab.serve.http_app` wires them to FastAPI).

A client that disconnects mid-stream stops generation; its session keeps exactly the
tokens sent: each token whose text was written to the connection before the server saw the
client leave (and those whose text was held back then, a possible start of a stop string or
of a multi-byte character). A token computed, or written, once the server has seen it leave
is not kept. A client that disconnects during a non-streaming request stops it too (polled
every ``DISCONNECT_POLL_S``): generation ends before the next token and the session keeps
the tokens committed until then. The session is released before the reply's end is sent
(the last chunk and ``[DONE]``, or the whole body), so a client's next turn finds it free.
``stop`` strings are matched on the detokenized text (:mod:`kakeya_lab.serve.stop_strings`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from kakeya_lab.backends.thread_pool import released
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.serve.openai_protocol import (
    ChatCompletionRequest,
    ModelNotFound,
    chunk_body,
    completion_body,
    error_body,
    extension,
    finish_reason,
    usage,
)
from kakeya_lab.serve.sessions import (
    ANONYMOUS,
    Attached,
    GenerateOptions,
    ServedSessions,
    ServedStream,
)
from kakeya_lab.serve.stop_strings import StopMatcher
from kakeya_lab.session import Done, Event, StreamingDetokenizer, Token

DISCONNECT_POLL_S = 0.05  # how often a non-streaming request checks for a hung-up client


def options_of(served: ServedSessions, req: ChatCompletionRequest) -> GenerateOptions:
    """The generation options of a request, checked against the server's limits (fields
    this server does not implement are refused, not ignored)."""
    req.refuse_unsupported()
    req.stop_strings()  # checked here; matched on the reply's text by the handlers
    if req.model not in (None, "", served.model_name):
        raise ModelNotFound(
            f"model {req.model!r} is not served here; this server serves {served.model_name!r}"
        )
    temperature = 0.0 if req.temperature is None else req.temperature
    sampling = SamplingConfig(
        temperature=temperature,
        top_k=req.top_k if temperature > 0 else None,
        top_p=req.top_p if temperature > 0 and req.top_p is not None else None,
        seed=req.seed,
    )
    options = GenerateOptions(
        max_new_tokens=req.max_new_tokens(),
        sampling=sampling,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        proposer=req.proposer,
        draft_length=req.draft_length,
        stop_strings=tuple(req.stop_strings()),
        allow_no_stop=req.allow_no_stop,
    )
    served.check_options(options)
    return options


def prepare(
    served: ServedSessions, req: ChatCompletionRequest, owner: str = ANONYMOUS
) -> tuple[GenerateOptions, Attached]:
    """Check the request and bind a session of ``owner`` (the conversation's new tokens
    appended)."""
    options = options_of(served, req)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    prompt_text, prompt_ids = served.render(messages, owner)
    return options, served.attach(
        prompt_ids, session_id=req.session_id, reuse=req.reuse, owner=owner, prompt_text=prompt_text
    )


def detokenizer(served: ServedSessions) -> StreamingDetokenizer:
    """The reply's text as it grows (end-of-sequence ids and special tokens not shown)."""
    return StreamingDetokenizer.for_tokenizer(served.tokenizer, skip_ids=served.store.eos_token_ids)


def response_base(served: ServedSessions, att: Attached) -> dict:
    """The fields every body of one completion shares."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "model": served.model_name,
        "session_id": att.session.id,
    }


async def complete(
    served: ServedSessions,
    req: ChatCompletionRequest,
    att: Attached,
    options: GenerateOptions,
    request: Request,
    t0: float,
) -> dict:
    """A whole completion's body; stops early if the client disconnects or a stop string
    appears. The session is released (closed for a stateless request) on every exit,
    before the body is returned; ``t0`` is when the request arrived
    (``time.perf_counter()``, for the latency metric)."""
    base = response_base(served, att)
    stops = req.stop_strings()
    gone = threading.Event()  # the client disconnected, or the reply is ready

    def run() -> tuple[str, int, Done | None, bool]:
        detok = detokenizer(served)
        matcher = StopMatcher(stops)
        shown: list[str] = []
        done = None
        events = served.generate(att.session.id, options, cancelled=gone.is_set)
        try:
            for event in events:
                if isinstance(event, Token):
                    shown.append(matcher.feed(detok.add(event.id)))
                    if matcher.stopped:
                        break  # the session keeps the tokens up to the stop string's end
                elif isinstance(event, Done):
                    done = event
        finally:
            events.close()
        text = "".join(shown) if matcher.stopped else detok.decode(detok.ids)
        return text, len(detok.ids), done, matcher.stopped

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
        text, n_tokens, done, stopped = await run_in_threadpool(released(run))
    finally:
        gone.set()
        watcher.cancel()
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(served.detach, att.session, close=stateless(req))
        served.metrics.request_latency.labels("http:chat").observe(time.perf_counter() - t0)
    return completion_body(base, att, text, n_tokens, done, stopped)


async def stream_chunks(
    served: ServedSessions,
    req: ChatCompletionRequest,
    att: Attached,
    events: ServedStream,
    cancel: threading.Event,
    disconnected: Callable[[], Awaitable[bool]],
    t0: float,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed completion of ``events`` (what
    :meth:`ServedSessions.generate` returned). Errors after the headers are reported
    in-band; ``cancel`` is set and the session released on every exit. When the reply
    ends normally the session is released *before* the last chunk and ``[DONE]`` are
    sent, so a client may send its next turn the moment it reads ``[DONE]``. Text that
    may be the start of a stop string is held back until it is clear. ``disconnected``
    says whether the server has seen the client leave (``Request.is_disconnected``): a
    token whose chunk was written after that is retracted. ``t0`` is when the request
    arrived."""
    base = response_base(served, att)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event | _StreamEnd] = asyncio.Queue()
    # One engine thread per stream pulls the events and hands each to the event loop.
    # It pulls the next event only once the previous one has been written (one credit),
    # so a client that leaves takes with it the session's every sent token and nothing
    # more: ``cancel`` stops the thread before the next, and a token it took that was
    # never sent is retracted (``handoff``).
    credit = threading.Semaphore(1)
    handoff = _Handoff()
    producer = threading.Thread(
        target=_produce,
        args=(events, loop, queue, credit, cancel, handoff),
        name="sse-stream",
        daemon=True,
    )
    detok = detokenizer(served)
    matcher = StopMatcher(req.stop_strings())
    done = None
    released = False

    async def release() -> None:
        # the engine thread has ended (the stream is closed): free the session
        nonlocal released
        if not released:
            released = True
            await anyio.to_thread.run_sync(lambda: served.detach(att.session, close=stateless(req)))

    try:
        yield _sse(chunk_body(base, {"role": "assistant", "content": ""}))
        producer.start()
        while True:
            event = await queue.get()
            if isinstance(event, _StreamEnd):
                if event.error is not None:
                    raise event.error
                break
            if isinstance(event, Token):
                delta = matcher.feed(detok.add(event.id))
                if delta:
                    yield _sse(chunk_body(base, {"content": delta}))
                    # The transport drops, silently, what it is given once it has read the
                    # client's close; one loop turn lets that close land before we ask.
                    await anyio.lowlevel.checkpoint()
                    if await disconnected():
                        return  # not sent: the engine thread retracts the token
                handoff.sent += 1
                if matcher.stopped:
                    cancel.set()  # a stop string: the engine ends before the next token
            elif isinstance(event, Done):
                done = event
            credit.release()  # handed on: the engine may pull the next event
        await anyio.to_thread.run_sync(producer.join)
        with anyio.CancelScope(shield=True):
            await release()
        rest = matcher.flush()
        if rest:
            yield _sse(chunk_body(base, {"content": rest}))
        yield _sse(
            chunk_body(
                base,
                {},
                finish_reason(done, matcher.stopped),
                usage=usage(att, len(detok.ids)),
                kakeya=extension(att, done),
            )
        )
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent: report in-band, then end the stream
        status, body = error_body(exc)
        served.metrics.errors.labels(str(status)).inc()
        yield _sse(body)
    finally:
        cancel.set()
        credit.release()  # a producer waiting for credit sees ``cancel`` and ends
        with anyio.CancelScope(shield=True):  # also on disconnect: keep exactly what was sent
            if producer.is_alive():
                await anyio.to_thread.run_sync(producer.join)
            elif producer.ident is None:  # never started
                await anyio.to_thread.run_sync(events.close)
            await release()
        served.metrics.request_latency.labels("http:chat_stream").observe(time.perf_counter() - t0)


def stateless(req: ChatCompletionRequest) -> bool:
    """A request with reuse off and no session: its fresh session is closed after it."""
    return not req.reuse and req.session_id is None


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


@dataclass
class _Handoff:
    """Tokens of one stream: ``taken`` from it by the engine thread, ``sent`` by the writer
    (written while the client was there, or held back). The credit orders their updates."""

    taken: int = 0
    sent: int = 0


@dataclass(frozen=True)
class _StreamEnd:
    """The engine thread's last item: the stream ended (``error``: how, if it failed)."""

    error: BaseException | None = None


def _produce(
    events: ServedStream,
    loop: asyncio.AbstractEventLoop,
    queue: asyncio.Queue,
    credit: threading.Semaphore,
    cancel: threading.Event,
    handoff: _Handoff,
) -> None:
    """Run in a stream's engine thread: pull each event once ``credit`` allows (the
    consumer releases it after handing the previous one on) and hand it to ``queue`` on
    ``loop``, until the stream ends or ``cancel`` is set; then a :class:`_StreamEnd`. The
    stream is closed here, in the thread that ran it, after retracting a token the
    consumer took no further (``handoff``)."""

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
            if isinstance(event, Token):
                handoff.taken += 1
            put(event)
    except Exception as exc:
        end = _StreamEnd(exc)
    finally:
        try:
            # Only the last token can be unsent: the next is pulled once it was written.
            # Read once the writer is done with it (it set ``cancel``, then the credit).
            if handoff.taken > handoff.sent:
                events.retract()
            events.close()
        finally:
            put(end)
