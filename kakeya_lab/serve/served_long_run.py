"""The long-run conversation driven through a running server by real clients.

Three client-driven arms, side by side over the same user turns (alternating turn by turn,
so they share machine conditions):

* ``grpc_session`` — the project's gRPC client: one session, each turn appends only the new
  user message (through the server's chat template) and streams the reply;
* ``http_reuse`` — the official ``openai`` client sending the whole conversation every
  turn; the server's prefix reuse finds the session and prefills only the new tokens;
* ``http_stateless`` — the same client with ``reuse: false``: the server re-prefills the
  whole conversation every turn (what a stateless endpoint does).

Per turn the rows carry the :class:`~kakeya_lab.bench.long_run.TurnRecord` columns that
:func:`~kakeya_lab.bench.aggregate.aggregate_arm` reads (``append_latency_s`` is the
server-measured prefill, ``kv_live_bytes`` / ``cache_len`` / ``history_len`` the server's
figures after the turn, ``rss_bytes`` the server process's RSS; ``user_tokens`` the new
message's tokens, chat template included, in every arm, as in-process: the turn's history
growth before its reply, while ``appended_tokens`` is what the server prefilled) plus client-side
``request_s`` and ``client_overhead_s_per_token`` (request time not spent in the server's
prefill and decode, per generated token).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import httpx
import openai
import pandas as pd
from openai.types.chat import ChatCompletionMessageParam

from kakeya_lab.serve.api_keys import auth_headers, client_key
from kakeya_lab.serve.client import SessionClient

ARMS = ("grpc_session", "http_reuse", "http_stateless")


def _server_rss(http_base: str) -> int:
    metrics = httpx.get(f"{http_base}/metrics", timeout=30, headers=auth_headers())
    for line in metrics.text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return int(float(line.split()[1]))
    return 0


def run_served_long_run(
    grpc_target: str,
    http_base: str,
    user_turns: Sequence[str],
    *,
    max_new_tokens: int = 32,
    model: str | None = None,
    arms: Sequence[str] = ARMS,
    turn_spacing_s: float | None = None,
    duration_s: float | None = None,
    stateless_cap_s: float | None = None,
    log: Callable[[str], None] | None = None,
) -> pd.DataFrame:
    """Drive ``user_turns`` through the server with every arm in ``arms``; one row per
    (arm, turn). ``http_base`` is ``http://HOST:PORT`` (no ``/v1``).

    ``turn_spacing_s``: round ``i`` (every arm's turn ``i``) starts ``i * turn_spacing_s``
    seconds after the start (at once when behind). ``duration_s``: no round starts after
    this much wall time. ``stateless_cap_s``: the ``http_stateless`` arm (whose requests
    grow with the conversation) stops after its first turn whose request took longer;
    the other arms go on. ``log`` gets one line per round."""
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown served arm(s) {sorted(unknown)}: use {', '.join(ARMS)}")
    for name, value in (
        ("turn_spacing_s", turn_spacing_s),
        ("duration_s", duration_s),
        ("stateless_cap_s", stateless_cap_s),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (got {value})")
    active = list(arms)
    oc = openai.OpenAI(  # a keyed server's key from $KAKEYA_LAB_API_KEY
        base_url=f"{http_base}/v1", api_key=client_key() or "unused", max_retries=0, timeout=600
    )
    model = model or oc.models.list().data[0].id
    rows: list[dict] = []
    t0 = time.perf_counter()
    with SessionClient(grpc_target, timeout_s=600) as client:
        sid = client.create() if "grpc_session" in arms else None
        conversations: dict[str, list[ChatCompletionMessageParam]] = {arm: [] for arm in arms}
        history_before = dict.fromkeys(arms, 0)  # each arm's history length after its last turn
        try:
            for i, text in enumerate(user_turns):
                if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                    break
                if turn_spacing_s is not None:
                    time.sleep(max(0.0, t0 + i * turn_spacing_s - time.perf_counter()))
                for arm in list(active):
                    if arm == "grpc_session" and sid is not None:  # sid: set for this arm
                        row = _grpc_turn(client, sid, text, max_new_tokens)
                    else:
                        row = _http_turn(
                            oc,
                            model,
                            conversations[arm],
                            text,
                            max_new_tokens,
                            reuse=arm == "http_reuse",
                        )
                    prompt_len = row["history_len"] - row["generated_tokens"]
                    row.update(
                        user_tokens=prompt_len - history_before[arm],
                        arm=arm,
                        turn=i,
                        wall_s=time.perf_counter() - t0,
                        rss_bytes=_server_rss(http_base),
                    )
                    history_before[arm] = row["history_len"]
                    rows.append(row)
                    if (
                        arm == "http_stateless"
                        and stateless_cap_s is not None
                        and row["request_s"] > stateless_cap_s
                    ):
                        active.remove(arm)
                        if log is not None:
                            log(
                                f"http_stateless stopped after turn {i}: a request took "
                                f"{row['request_s']:.1f}s > {stateless_cap_s}s"
                            )
                if log is not None:
                    log(
                        f"turn {i}: "
                        + "  ".join(
                            f"{r['arm']} {r['request_s']:.2f}s (prefill {r['append_latency_s']:.3f}s)"
                            for r in rows
                            if r["turn"] == i
                        )
                    )
        finally:
            if sid is not None:
                client.close_session(sid)
            if "http_reuse" in arms and rows:
                last = [r for r in rows if r["arm"] == "http_reuse"]
                if last:
                    httpx.delete(
                        f"{http_base}/v1/sessions/{last[-1]['session_id']}",
                        timeout=30,
                        headers=auth_headers(),
                    )
    return pd.DataFrame(rows)


def _grpc_turn(client: SessionClient, sid: str, text: str, max_new_tokens: int) -> dict:
    t = time.perf_counter()
    appended = client.append_text(sid, text)
    reply = client.generate(sid, max_new_tokens)
    request_s = time.perf_counter() - t
    done = reply.done
    if done is None:
        raise RuntimeError(f"session {sid!r}: the gRPC stream ended without a done event")
    n = max(1, done.generated_tokens)
    return {
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
        "session_id": sid,
        "error": None,
    }


def _http_turn(
    oc: openai.OpenAI,
    model: str,
    messages: list[ChatCompletionMessageParam],
    text: str,
    max_new_tokens: int,
    *,
    reuse: bool,
) -> dict:
    messages.append({"role": "user", "content": text})
    t = time.perf_counter()
    resp = oc.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_new_tokens,
        temperature=0.0,
        extra_body={"reuse": reuse},
    )
    request_s = time.perf_counter() - t
    content = resp.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": content})
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
        "session_id": ext["session_id"],
        "error": None,
    }
