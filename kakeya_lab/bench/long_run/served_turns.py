"""One turn of the long-run conversation through a running server, by real clients.

Three client-driven arms, side by side over the same user turns (alternating turn by turn,
so they share machine conditions; :mod:`kakeya_lab.bench.long_run.served_driver` drives
the rounds, checkpoints and resumes):

* ``grpc_session`` — the project's gRPC client: one session, each turn appends only the new
  user message (through the server's chat template) and streams the reply. The client
  keeps a mirror of the conversation (:class:`~kakeya_lab.chat.ChatTemplate` with the
  model's tokenizer, checked turn by turn against what the server appended) so that a
  session re-created after a resume or a server restart can be given the very token ids
  the old one held; such a session goes on in token mode (the mirror renders each user
  message, the same ids the server's template would give);
* ``http_reuse`` — the official ``openai`` client sending the whole conversation every
  turn; the server's prefix reuse finds the session and prefills only the new tokens;
* ``http_stateless`` — the same client with ``reuse: false``: the server re-prefills the
  whole conversation every turn (what a stateless endpoint does).

Per turn the rows carry the :class:`~kakeya_lab.bench.long_run.TurnRecord` columns that
:func:`~kakeya_lab.bench.aggregate.aggregate_arm` reads (``append_latency_s`` is the
server-measured prefill, ``kv_live_bytes`` / ``cache_len`` / ``history_len`` the server's
figures after the turn, ``rss_bytes`` the server process's RSS when an HTTP endpoint is
known; ``user_tokens`` the new message's tokens, chat template included, in every arm, as
in-process: the turn's history growth before its reply, while ``appended_tokens`` is what
the server prefilled) plus client-side ``request_s`` and ``client_overhead_s_per_token``
(request time not spent in the server's prefill and decode, per generated token), the
reply's digest (``reply_ids_sha256`` of the gRPC reply's token ids, ``reply_sha256`` of an
HTTP reply's text) and the speculative counts (``proposed``, ``accepted``).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx

from kakeya_lab.bench.long_run.records import ids_digest
from kakeya_lab.serve.api_keys import auth_headers

ARMS = ("grpc_session", "http_reuse", "http_stateless")
GRPC_ARMS = ("grpc_session",)
HTTP_ARMS = ("http_reuse", "http_stateless")


class ServerGone(Exception):
    """The server did not answer (down, restarting) or no longer knows the arm's session
    (a restarted server): the driver waits for it and re-creates the session."""


def is_server_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the server is unreachable or lost the session: gRPC
    ``UNAVAILABLE`` / ``NOT_FOUND``, a refused or dropped HTTP connection."""
    if isinstance(exc, ServerGone):
        return True
    try:
        import grpc

        if isinstance(exc, grpc.RpcError) and exc.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.NOT_FOUND,
        ):
            return True
    except ImportError:  # pragma: no cover - the serve extra is missing
        pass
    try:
        import openai

        if isinstance(exc, openai.APIConnectionError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, httpx.TransportError)


def error_text(exc: BaseException) -> str:
    """One line for a failed turn's ``error`` column: the type and the server's message."""
    try:
        import grpc

        if isinstance(exc, grpc.RpcError):
            return f"{exc.code().name}: {exc.details()}"
    except ImportError:  # pragma: no cover
        pass
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def server_rss(http_base: str | None) -> int | None:
    """The server process's resident set size from ``/metrics`` (None without an HTTP
    endpoint or when it cannot be read)."""
    if http_base is None:
        return None
    try:
        metrics = httpx.get(f"{http_base}/metrics", timeout=30, headers=auth_headers())
    except httpx.HTTPError:
        return None
    for line in metrics.text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return int(float(line.split()[1]))
    return None


def grpc_turn(
    client,
    sid: str,
    text: str,
    max_new_tokens: int,
    *,
    chat,
    token_mode: bool,
    proposer: str | None = None,
    draft_length: int = 4,
) -> tuple[dict, list[int]]:
    """One gRPC turn: append ``text`` (through the server's template, or in ``token_mode``
    the ids ``chat`` renders), stream the reply; ``chat`` (the client's mirror) records
    both. Returns the row and the ids the session committed (user delta + reply). The
    caller restores ``chat`` if this raises."""
    user_ids = chat.user(text)  # rendered before the clock starts: not the server's time
    t = time.perf_counter()
    if token_mode:
        appended = client.append_ids(sid, user_ids)
    else:
        appended = client.append_text(sid, text)
        if len(user_ids) != appended.appended_tokens:
            raise RuntimeError(
                f"the client's chat template gives {len(user_ids)} ids for this message, the "
                f"server appended {appended.appended_tokens}: client and server tokenizers differ"
            )
    options: dict[str, Any] = {}
    if proposer is not None:
        options.update(proposer=proposer, draft_length=draft_length)
    reply = client.generate(sid, max_new_tokens, **options)
    request_s = time.perf_counter() - t
    done = reply.done
    if done is None:
        raise RuntimeError(f"session {sid!r}: the gRPC stream ended without a done event")
    ids = list(reply.token_ids)
    # the server's template closes a reply on its end-of-turn token; stop_reason says it ended so
    eos = {ids[-1]} if ids and done.stop_reason == "eos" else set()
    chat.generated(ids, eos_token_ids=eos)
    n = max(1, done.generated_tokens)
    row = {
        "appended_tokens": appended.appended_tokens,
        "cached_tokens": appended.history_len - appended.appended_tokens,
        "append_latency_s": appended.latency_s,
        "first_token_s": appended.latency_s + done.first_token_s,
        "generate_s": done.total_s,
        "decode_s_per_token": done.total_s / n,
        "generated_tokens": done.generated_tokens,
        "stop_reason": done.stop_reason,
        "kv_live_bytes": done.kv_live_bytes,
        "cache_len": done.cache_len,
        "history_len": done.history_len,
        "request_s": request_s,
        "client_overhead_s_per_token": (request_s - appended.latency_s - done.total_s) / n,
        "reply": reply.text,
        "reply_ids_sha256": ids_digest(ids),
        "proposed": int(done.proposed),
        "accepted": int(done.accepted),
        "session_id": sid,
        "error": None,
    }
    return row, list(user_ids) + ids


def http_turn(
    oc,
    model: str,
    messages: list,
    text: str,
    max_new_tokens: int,
    *,
    reuse: bool,
    proposer: str | None = None,
    draft_length: int = 4,
) -> dict:
    """One OpenAI-client turn over the whole conversation ``messages`` (extended with the
    user message and the reply only when the turn succeeds)."""
    sent = [*messages, {"role": "user", "content": text}]
    extra: dict[str, Any] = {"reuse": reuse}
    if proposer is not None:
        extra.update(proposer=proposer, draft_length=draft_length)
    t = time.perf_counter()
    resp = oc.chat.completions.create(
        model=model,
        messages=sent,
        max_tokens=max_new_tokens,
        temperature=0.0,
        extra_body=extra,
    )
    request_s = time.perf_counter() - t
    content = resp.choices[0].message.content or ""
    if resp.model_extra is None or "kakeya" not in resp.model_extra:
        raise RuntimeError(
            f"{model!r}: the reply has no kakeya extension (not a kakeya-lab server?)"
        )
    ext = resp.model_extra["kakeya"]
    details = resp.usage.prompt_tokens_details if resp.usage is not None else None
    if details is None or details.cached_tokens is None:
        raise RuntimeError(
            f"{model!r}: the reply's usage has no prompt_tokens_details.cached_tokens"
        )
    messages[:] = [*sent, {"role": "assistant", "content": content}]
    counts, timings = ext["generation"]["counts"], ext["generation"]["timings"]
    n = max(1, counts["generated_tokens"])
    return {
        "appended_tokens": ext["appended_tokens"],
        "cached_tokens": details.cached_tokens,
        "append_latency_s": ext["prefill_s"],
        "first_token_s": ext["prefill_s"] + (timings["first_token_s"] or 0.0),
        "generate_s": timings["total_s"],
        "decode_s_per_token": timings["total_s"] / n,
        "generated_tokens": counts["generated_tokens"],
        "stop_reason": "eos" if resp.choices[0].finish_reason == "stop" else "max_tokens",
        "kv_live_bytes": counts["kv_live_bytes"],
        "cache_len": counts["cache_len"],
        "history_len": counts["history_len"],
        "request_s": request_s,
        "client_overhead_s_per_token": (request_s - ext["prefill_s"] - timings["total_s"]) / n,
        "reply": content,
        "reply_sha256": hashlib.sha256(content.encode()).hexdigest()[:16],
        "proposed": int(counts.get("proposed") or 0),
        "accepted": int(counts.get("accepted") or 0),
        "session_id": ext["session_id"],
        "error": None,
    }
