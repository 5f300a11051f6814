"""One turn of one arm: append the new user message, generate a greedy reply, record it."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING, cast

import psutil

from kakeya_lab.bench.aggregate import repetition_rate
from kakeya_lab.bench.long_run.checkpoint import ArmState, new_session
from kakeya_lab.bench.long_run.probe import FactProbe, probe_recall
from kakeya_lab.bench.long_run.records import TurnRecord, ids_digest
from kakeya_lab.session import chat_turn, collect_reply

if TYPE_CHECKING:
    from kakeya_lab.proposers import Proposer


def run_turn(
    loaded,
    state: ArmState,
    text: str,
    turn: int,
    max_new_tokens: int,
    t0: float,
    probe: FactProbe | None,
    plant_at: int,
    eos_ids: Collection[int],
) -> TurnRecord:
    """Run turn ``turn`` of one arm; ``t0`` is the run's wall-clock origin
    (``time.perf_counter()``), ``plant_at`` the history length where the fact was planted."""
    arm = state.arm
    prefix: list[int] = []
    if arm.stateless:  # a fresh session that re-prefills the whole conversation
        store, sid = new_session(loaded, arm)
        state.store, state.sid = store, sid
        prefix = state.history_ids
    else:
        if state.store is None or state.sid is None:
            raise RuntimeError(
                f"arm {arm.name!r} has no session: build its state with fresh_progress or load_progress"
            )
        store, sid = state.store, state.sid
    # ArmState keeps the proposer untyped (it is rebuilt on resume); it is a Proposer or None.
    proposer = cast("Proposer | None", state.proposer)
    user_turn = chat_turn(
        store,
        sid,
        state.chat,
        text,
        max_new_tokens,
        prefix_ids=prefix,
        proposer=proposer,
        draft_length=arm.draft_length,
    )
    result = collect_reply(user_turn)
    delta, appended = user_turn.prompt_ids, user_turn.appended
    assert appended is not None  # chat_turn always appends the user turn
    reply, done = result.token_ids, result.done
    truncated = appended.dropped > 0 or result.truncated_dropped is not None
    state.history_ids += delta + reply
    reply_text = user_turn.text or ""
    info = store.info(sid)
    record = TurnRecord(
        arm=arm.name,
        turn=turn,
        user_tokens=len(delta),
        append_latency_s=appended.latency_s,
        first_token_s=appended.latency_s + (done.timings.first_token_s or 0.0),
        generate_s=done.timings.total_s,
        decode_s_per_token=done.timings.total_s / max(1, done.counts.generated_tokens),
        generated_tokens=done.counts.generated_tokens,
        stop_reason=done.stop_reason,
        kv_live_bytes=info.kv_live_bytes,
        cache_len=info.cache_len,
        history_len=info.history_len,
        rss_bytes=psutil.Process().memory_info().rss,
        truncated=truncated,
        dropped_total=info.history_len - info.cache_len,
        wall_s=time.perf_counter() - t0,
        repetition=repetition_rate(reply),
        reply=reply_text,
        proposed=done.counts.proposed,
        accepted=done.counts.accepted,
        tau=done.counts.tau,
        proposer_s=done.timings.proposer_s,
        reply_ids_sha256=ids_digest(reply),
    )
    if probe is not None and (turn + 1) % probe.every == 0:
        answer = probe_recall(store, sid, state.chat, probe, eos_ids)
        record.probe_reply = answer
        record.probe_recalled = probe.answer in answer
        record.probe_distance_tokens = info.history_len - plant_at
    if arm.stateless:
        store.close(sid)
    return record
