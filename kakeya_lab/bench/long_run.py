"""Multi-turn session runs: several cache arms driven side by side over the same turns.

Each arm is a :class:`~kakeya_lab.session.SessionStore` session with its own cache
configuration (e.g. ``sink_window`` and a never-evicting ``full_cache``). Turns are
interleaved arm by arm, so every arm sees the same machine conditions. Per turn the
recorder keeps append latency, time to first token, generate latency, tokens generated,
``kv_live_bytes``, cache length and history length.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import pandas as pd
from tqdm.auto import tqdm

from kakeya_lab.cache import SinkWindowConfig
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.session import Done, HistoryTruncated, SessionStore, Token


@dataclass
class TurnRecord:
    arm: str
    turn: int
    user_tokens: int
    append_latency_s: float
    first_token_s: float | None
    generate_s: float
    generated_tokens: int
    stop_reason: str
    kv_live_bytes: int
    cache_len: int
    history_len: int
    truncated: bool
    wall_s: float
    reply: str


@dataclass
class TurnsRun:
    """The per-turn table and, per arm, the live session (store, id) it ran in."""

    turns: pd.DataFrame
    sessions: dict[str, tuple[SessionStore, str]]


def run_turns(
    loaded,
    arms: Mapping[str, SinkWindowConfig],
    user_turns: Iterable[str],
    *,
    max_new_tokens: int = 32,
    system: str | None = None,
    progress: bool = True,
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> TurnsRun:
    """Drive one chat session per arm through ``user_turns``; one row per (arm, turn).

    Greedy decoding; each turn appends only the new, chat-templated user message.
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    turns = list(user_turns)
    if not turns:
        raise ValueError("no user turns to run")
    if not arms:
        raise ValueError("no arms to run")
    sessions = {}
    for name, config in arms.items():
        store = SessionStore(model, config, capacity=1)
        sessions[name] = (store, store.create(), ChatTemplate(tokenizer, system=system))
    rows: list[TurnRecord] = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(turns) * len(arms), desc="turns", disable=not progress, unit="turn")
    for i, text in enumerate(turns):
        for name, (store, sid, chat) in sessions.items():
            delta = chat.user(text)
            appended = store.append(sid, delta)
            reply, truncated, done = [], appended.dropped > 0, None
            for event in store.generate(sid, max_new_tokens):
                if isinstance(event, Token):
                    reply.append(event.id)
                elif isinstance(event, HistoryTruncated):
                    truncated = True
                elif isinstance(event, Done):
                    done = event
            reply_text = chat.generated(reply, eos_token_ids=store.eos_token_ids)
            record = TurnRecord(
                arm=name,
                turn=i,
                user_tokens=len(delta),
                append_latency_s=appended.latency_s,
                first_token_s=appended.latency_s + (done.timings["first_token_s"] or 0.0),
                generate_s=done.timings["total_s"],
                generated_tokens=done.counts["generated_tokens"],
                stop_reason=done.stop_reason,
                kv_live_bytes=done.counts["kv_live_bytes"],
                cache_len=done.counts["cache_len"],
                history_len=done.counts["history_len"],
                truncated=truncated,
                wall_s=time.perf_counter() - t0,
                reply=reply_text,
            )
            rows.append(record)
            if on_turn is not None:
                on_turn(record)
            bar.update(1)
    bar.close()
    table = pd.DataFrame([asdict(r) for r in rows])
    return TurnsRun(turns=table, sessions={name: (s[0], s[1]) for name, s in sessions.items()})


def summarize_turns(turns: pd.DataFrame, configs: Mapping[str, SinkWindowConfig]) -> dict[str, dict]:
    """Per arm: final history/cache sizes, KV bytes before and after the cache filled, and
    median append and per-token decode latency in the first and last third of the turns.

    ``kv_flat_after_full`` is True only if the cache did fill and ``kv_live_bytes`` never
    changed afterwards (never for an arm whose cache never filled, nor for a zero series).
    """
    out: dict[str, dict] = {}
    for arm, df in turns.groupby("arm", sort=False):
        config = configs[arm]
        third = max(1, len(df) // 3)
        head, tail = df.iloc[:third], df.iloc[-third:]
        per_token = df["generate_s"] / df["generated_tokens"].clip(lower=1)
        full = df[df["cache_len"] == config.budget] if config.budget is not None else df.iloc[0:0]
        kv_after = full["kv_live_bytes"]
        out[arm] = {
            "turns": int(len(df)),
            "history_len_last": int(df["history_len"].iloc[-1]),
            "cache_len_last": int(df["cache_len"].iloc[-1]),
            "kv_live_bytes_first": int(df["kv_live_bytes"].iloc[0]),
            "kv_live_bytes_last": int(df["kv_live_bytes"].iloc[-1]),
            "kv_live_bytes_max": int(df["kv_live_bytes"].max()),
            "cache_filled_at_turn": int(full["turn"].iloc[0]) if len(full) else None,
            "kv_flat_after_full": bool(len(kv_after) > 1 and kv_after.min() > 0 and kv_after.nunique() == 1),
            "append_latency_p50_first_s": float(head["append_latency_s"].median()),
            "append_latency_p50_last_s": float(tail["append_latency_s"].median()),
            "decode_s_per_token_p50_first": float(per_token.iloc[:third].median()),
            "decode_s_per_token_p50_last": float(per_token.iloc[-third:].median()),
            "generated_tokens": int(df["generated_tokens"].sum()),
        }
    return out
