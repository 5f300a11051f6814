"""Long-run session benchmark: cache arms side by side over the same chat turns.

Arms (:func:`standard_arms`):

* ``sink_window`` — our session runtime with a sink-window cache;
* ``full_cache`` — the same runtime with a cache that never evicts (memory grows);
* ``reprefill`` — stateless, OpenAI-style: every turn re-prefills the whole conversation
  into a fresh cache, as an HTTP chat endpoint does (latency grows). It stops once a turn
  takes longer than ``reprefill_cap_s``, which is recorded.

Each turn appends only the new chat-templated user message (stateful arms) and generates a
greedy reply (EOS or ``max_new_tokens``). Arms alternate turn by turn, so they share
machine conditions. Per turn the recorder keeps append latency, time to first token,
generate latency, tokens generated, ``kv_live_bytes``, cache and history length, process
RSS and truncation. Quality probes keep a flat latency curve from being mistaken for a
useful session: a fact planted in the first turn is asked for every ``probe.every`` turns
on a provisional block that is rolled back (the session does not see the question), and
EOS and repetition rates are recorded.

Results are checkpointed atomically every ``checkpoint_every`` turns into ``out_dir``;
:func:`run_long` resumes from the checkpoint (replaying each arm's committed history into a
fresh session gives the same cache) and loses no completed turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import psutil
from tqdm.auto import tqdm

from kakeya_lab.bench.aggregate import aggregate_arm, repetition_rate
from kakeya_lab.cache import SinkWindowConfig, analytic_kv_budget_bytes
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.results import write_json_atomic
from kakeya_lab.session import Done, HistoryTruncated, SessionStore, Token, model_eos_ids
from kakeya_lab.verifier import Verifier

CHECKPOINT = "checkpoint.json"


class DegenerateRun(RuntimeError):
    """A run whose numbers would be meaningless (e.g. ``kv_live_bytes`` zero)."""


@dataclass(frozen=True)
class Arm:
    """One way of serving the conversation. ``stateless``: a fresh cache every turn."""

    name: str
    config: SinkWindowConfig
    stateless: bool = False


def standard_arms(
    sink: int, window: int, positions: str = "global",
    names: Sequence[str] = ("sink_window", "full_cache", "reprefill"),
) -> dict[str, Arm]:
    full = SinkWindowConfig(sink=0, window=None)
    known = {
        "sink_window": Arm("sink_window", SinkWindowConfig(sink=sink, window=window, positions=positions)),
        "full_cache": Arm("full_cache", full),
        "reprefill": Arm("reprefill", full, stateless=True),
    }
    unknown = set(names) - set(known)
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; known: {sorted(known)}")
    return {n: known[n] for n in names}


@dataclass(frozen=True)
class FactProbe:
    """A fact planted in the first user turn, asked for every ``every`` turns."""

    fact: str = "my locker code is 4812"
    question: str = "What is my locker code? Answer with the number only."
    answer: str = "4812"
    every: int = 25


@dataclass
class TurnRecord:
    arm: str
    turn: int
    user_tokens: int
    append_latency_s: float
    first_token_s: float | None
    generate_s: float
    decode_s_per_token: float | None
    generated_tokens: int
    stop_reason: str
    kv_live_bytes: int
    cache_len: int
    history_len: int
    rss_bytes: int
    truncated: bool
    dropped_total: int
    wall_s: float
    repetition: float
    reply: str
    probe_recalled: bool | None = None
    probe_distance_tokens: int | None = None
    probe_reply: str | None = None
    error: str | None = None


@dataclass
class _ArmState:
    arm: Arm
    chat: ChatTemplate
    history_ids: list[int] = field(default_factory=list)
    store: SessionStore | None = None
    sid: str | None = None
    stopped: str | None = None  # why this arm stopped early


@dataclass
class LongRun:
    turns: pd.DataFrame
    arms: dict[str, Arm]
    summary: dict[str, dict]
    states: dict[str, _ArmState]

    def session(self, arm: str) -> tuple[SessionStore, str]:
        state = self.states[arm]
        return state.store, state.sid


def _new_session(loaded, arm: Arm) -> tuple[SessionStore, str]:
    store = SessionStore(loaded.model, arm.config, capacity=1)
    return store, store.create()


def _chat_state(chat: ChatTemplate) -> dict:
    return {"messages": chat.messages, "rendered": chat.rendered, "awaiting_reply": chat.awaiting_reply}


def _restore_chat(tokenizer, state: dict) -> ChatTemplate:
    chat = ChatTemplate(tokenizer)
    chat.messages = list(state["messages"])
    chat.rendered = state["rendered"]
    chat.awaiting_reply = state["awaiting_reply"]
    return chat


def probe_recall(verifier: Verifier, chat: ChatTemplate, probe: FactProbe, eos_ids, max_new_tokens: int = 12) -> str:
    """Ask ``probe.question`` on a provisional block and roll it back: the session is
    unchanged afterwards. Returns the greedy answer text."""
    scratch = ChatTemplate(chat.tokenizer)
    scratch.messages, scratch.rendered = list(chat.messages), chat.rendered
    ids = scratch.user(probe.question)
    logits = verifier.forward_block(ids)[-1]
    answer = []
    try:
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            if token in eos_ids:
                break
            answer.append(token)
            logits = verifier.forward_block([token])[-1]
    finally:
        verifier.rollback()
    return chat.tokenizer.decode(answer, skip_special_tokens=True)


def run_long(
    loaded,
    arms: Mapping[str, Arm],
    user_turns: Sequence[str],
    *,
    max_new_tokens: int = 32,
    out_dir: str | Path | None = None,
    checkpoint_every: int = 10,
    duration_s: float | None = None,
    probe: FactProbe | None = None,
    reprefill_cap_s: float | None = 30.0,
    turns_per_bucket: int = 50,
    progress: bool = True,
) -> LongRun:
    """Drive every arm through ``user_turns`` (cycled when ``duration_s`` asks for more).

    With ``out_dir`` the run checkpoints there and resumes from an existing checkpoint
    (same arms and turns required). Raises :class:`DegenerateRun` on meaningless numbers.
    """
    turns = list(user_turns)
    if not turns:
        raise ValueError("no user turns to run")
    if not arms:
        raise ValueError("no arms to run")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    tok = loaded.tokenizer
    model_eos = model_eos_ids(loaded.model)
    out = Path(out_dir) if out_dir is not None else None
    rows: list[dict] = []
    states: dict[str, _ArmState] = {}
    wall_offset = 0.0
    start_turn = 0
    plant_len: dict[str, int] = {}
    checkpoint = out / CHECKPOINT if out is not None else None
    if checkpoint is not None and checkpoint.exists():
        saved = json.loads(checkpoint.read_text())
        if sorted(saved["arms"]) != sorted(arms) or saved["turns_total"] != len(turns):
            raise ValueError(f"{checkpoint} belongs to another run (arms or turns differ); use a new out_dir")
        rows, wall_offset, start_turn = saved["rows"], saved["wall_s"], saved["next_turn"]
        plant_len = saved.get("plant_len", {})
        for name, arm in arms.items():
            s = saved["arms"][name]
            state = _ArmState(arm, _restore_chat(tok, s["chat"]), list(s["history_ids"]), stopped=s["stopped"])
            if not arm.stateless and state.history_ids:
                state.store, state.sid = _new_session(loaded, arm)
                state.store.append(state.sid, state.history_ids)  # replay: same cache as before
            states[name] = state
    else:
        for name, arm in arms.items():
            state = _ArmState(arm, ChatTemplate(tok))
            if not arm.stateless:
                state.store, state.sid = _new_session(loaded, arm)
            states[name] = state

    def save(next_turn: int, wall: float) -> None:
        if checkpoint is None:
            return
        _refuse_degenerate(rows)
        write_json_atomic(checkpoint, {
            "turns_total": len(turns), "next_turn": next_turn, "wall_s": wall, "plant_len": plant_len,
            "rows": rows,
            "arms": {n: {"history_ids": s.history_ids, "chat": _chat_state(s.chat), "stopped": s.stopped}
                     for n, s in states.items()},
        })

    t0 = time.perf_counter() - wall_offset
    n_turns = len(turns) if duration_s is None else None
    bar = tqdm(total=n_turns, initial=start_turn, desc="long run", unit="turn", disable=not progress)
    i = start_turn
    while (n_turns is None or i < n_turns) and (duration_s is None or time.perf_counter() - t0 < duration_s):
        text = turns[i % len(turns)]
        if i == 0 and probe is not None:
            text = f"Please remember this: {probe.fact}. {text}"
        for name, state in states.items():
            if state.stopped:
                continue
            if i == 0:
                plant_len[name] = len(state.history_ids)
            try:
                rows.append(asdict(_run_turn(loaded, state, text, i, max_new_tokens, t0, probe,
                                             plant_len.get(name, 0), model_eos, turns_per_probe=probe.every if probe else 0)))
            except Exception as exc:  # recorded; the arm stops, the others go on
                state.stopped = f"turn {i}: {type(exc).__name__}: {exc}"
                rows.append({"arm": name, "turn": i, "error": state.stopped, "wall_s": time.perf_counter() - t0})
                continue
            if state.arm.stateless and reprefill_cap_s is not None and rows[-1]["append_latency_s"] + rows[-1]["generate_s"] > reprefill_cap_s:
                state.stopped = f"stopped after turn {i}: a turn took longer than {reprefill_cap_s}s"
        i += 1
        bar.update(1)
        if i % checkpoint_every == 0:
            save(i, time.perf_counter() - t0)
    bar.close()
    save(i, time.perf_counter() - t0)
    _refuse_degenerate(rows)
    table = pd.DataFrame(rows)
    if "error" not in table:
        table["error"] = None
    budgets = {n: analytic_kv_budget_bytes(loaded.model, a.config) for n, a in arms.items()}
    summary = summarize_long_run(table, arms, budgets, turns_per_bucket=turns_per_bucket)
    for name, state in states.items():
        summary[name]["stopped"] = state.stopped
    if out is not None:
        table.to_csv(out / "turns.csv", index=False)
    return LongRun(turns=table, arms=dict(arms), summary=summary, states=states)


def _run_turn(loaded, state: _ArmState, text: str, i: int, max_new_tokens: int, t0: float,
              probe: FactProbe | None, plant_at: int, eos_ids, turns_per_probe: int) -> TurnRecord:
    arm = state.arm
    delta = state.chat.user(text)
    if arm.stateless:  # a fresh session that re-prefills the whole conversation
        state.store, state.sid = _new_session(loaded, arm)
        appended = state.store.append(state.sid, state.history_ids + delta)
    else:
        appended = state.store.append(state.sid, delta)
    state.history_ids += delta
    reply, done, truncated = [], None, appended.dropped > 0
    for event in state.store.generate(state.sid, max_new_tokens):
        if isinstance(event, Token):
            reply.append(event.id)
        elif isinstance(event, HistoryTruncated):
            truncated = True
        elif isinstance(event, Done):
            done = event
    state.history_ids += reply
    reply_text = state.chat.generated(reply, eos_token_ids=eos_ids)
    info = state.store.info(state.sid)
    record = TurnRecord(
        arm=arm.name, turn=i, user_tokens=len(delta), append_latency_s=appended.latency_s,
        first_token_s=appended.latency_s + (done.timings["first_token_s"] or 0.0),
        generate_s=done.timings["total_s"],
        decode_s_per_token=done.timings["total_s"] / max(1, done.counts["generated_tokens"]),
        generated_tokens=done.counts["generated_tokens"], stop_reason=done.stop_reason,
        kv_live_bytes=info.kv_live_bytes, cache_len=info.cache_len, history_len=info.history_len,
        rss_bytes=psutil.Process().memory_info().rss, truncated=truncated,
        dropped_total=info.history_len - info.cache_len, wall_s=time.perf_counter() - t0,
        repetition=repetition_rate(reply), reply=reply_text,
    )
    if probe is not None and turns_per_probe and (i + 1) % turns_per_probe == 0:
        answer = probe_recall(state.store.verifier(state.sid), state.chat, probe, eos_ids)
        record.probe_reply = answer
        record.probe_recalled = probe.answer in answer
        record.probe_distance_tokens = info.history_len - plant_at
    if arm.stateless:
        state.store.close(state.sid)
    return record


def _refuse_degenerate(rows: list[dict]) -> None:
    ok = [r for r in rows if not r.get("error")]
    zero = [r for r in ok if r.get("kv_live_bytes", 0) <= 0]
    if zero:
        raise DegenerateRun(
            f"kv_live_bytes is zero on {len(zero)} turn(s) (first: arm {zero[0]['arm']}, turn {zero[0]['turn']}): "
            "a bug, not a result"
        )


def summarize_long_run(
    table: pd.DataFrame, arms: Mapping[str, Arm], budget_bytes: Mapping[str, int | None],
    *, turns_per_bucket: int = 50,
) -> dict[str, dict]:
    """:func:`~kakeya_lab.bench.aggregate.aggregate_arm` for every arm, plus quality probes.
    ``budget_bytes``: the analytic KV budget per arm (None for caches that never evict)."""
    out = {}
    for name, arm in arms.items():
        df = table[table["arm"] == name]
        budget_tokens = arm.config.budget
        summary = aggregate_arm(df, budget_tokens=budget_tokens, budget_bytes=budget_bytes[name],
                                turns_per_bucket=turns_per_bucket)
        summary["budget_bytes"] = budget_bytes[name]
        if "probe_recalled" in df and df["probe_recalled"].notna().any():
            probes = df[df["probe_recalled"].notna()]
            summary["probes"] = [
                {"turn": int(r.turn), "distance_tokens": int(r.probe_distance_tokens), "recalled": bool(r.probe_recalled)}
                for r in probes.itertuples()
            ]
            summary["recall_rate"] = float(probes["probe_recalled"].astype(bool).mean())
        out[name] = summary
    return out


def long_run_headline(summary: dict[str, dict]) -> dict[str, dict]:
    """The few numbers per arm that the run index shows."""
    out = {}
    for arm, s in summary.items():
        drift = s.get("latency_drift_p50_by_turns", {}).get("append_latency_s", {})
        out[arm] = {
            "turns": s.get("turns"),
            "kv_bounded": s.get("kv_bounded"),
            "prefill_bounded": s.get("prefill_bounded"),
            "append_p50_drift_pct": drift.get("drift_pct"),
            "append_last_over_first_bucket": s.get("append_latency_last_over_first_bucket"),
            "rss_drift_pct": (s.get("rss_drift") or {}).get("drift_pct"),
            "recall_rate": s.get("recall_rate"),
        }
    return out
