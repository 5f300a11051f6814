"""Load, CI-sized: 8 concurrent sessions x 50 turns against a real ``kakeya-lab serve``
(the default model, its steps batched as the server does by default; short turns of 6
token ids and 2-token greedy replies keep it to minutes on a shared 2-core machine). Every reply equals a clean sequential in-process run
over the same cache configuration, and afterwards the server is back to its baseline
(open sessions and live KV bytes exactly; the live heap and RSS within the tolerances of
``Server.assert_back_to`` in conftest)."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc", reason="needs the serve extra")

from kakeya_lab.backends.config import SinkWindowConfig  # noqa: E402
from kakeya_lab.serve.load import latency_summary, load_conversations, run_load  # noqa: E402
from kakeya_lab.session import SessionStore, Token  # noqa: E402

pytestmark = pytest.mark.slow

SINK, WINDOW = 4, 60  # 50 turns x 8 tokens: the window evicts many times over
SESSIONS, TURNS, NEW_TOKENS = 8, 50, 2


def test_concurrent_load_equals_a_sequential_clean_run_and_leaks_nothing(serve, default_model):
    server = serve("--sink", str(SINK), "--window", str(WINDOW), "--capacity", str(SESSIONS))
    assert "batched steps on" in server.ready  # the server's default for this model
    conversations = load_conversations(SESSIONS, TURNS)
    # Warm up at full concurrency until every session's cache is full (10 turns x 8 tokens >
    # sink + window), then once more as long as half the run, so the allocator and the
    # kernels' per-shape caches have seen the peak (batched steps meet a new mix of row
    # counts for a while) before the baseline is taken.
    run_load(server.grpc_target, load_conversations(SESSIONS, 10, seed=1), NEW_TOKENS)
    run_load(server.grpc_target, load_conversations(SESSIONS, TURNS // 2, seed=2), NEW_TOKENS)
    before = server.footprint()
    assert before["sessions"] == before["kv"] == 0

    result = run_load(server.grpc_target, conversations, NEW_TOKENS)

    server.assert_back_to(before)
    summary = latency_summary(result)
    assert (
        summary["turns"] == SESSIONS * TURNS and summary["turn_p99_s"] >= summary["turn_p50_s"] > 0
    )
    print(summary)

    store = SessionStore(
        default_model.model, SinkWindowConfig(sink=SINK, window=WINDOW), capacity=1
    )
    for s, turns in enumerate(conversations):  # the clean run: one session at a time
        sid = store.create()
        expected = []
        for ids in turns:
            store.append(sid, ids)
            expected.append([e.id for e in store.generate(sid, NEW_TOKENS) if isinstance(e, Token)])
        store.close(sid)
        assert result.replies[s] == expected, f"session {s} differs from the clean run"
