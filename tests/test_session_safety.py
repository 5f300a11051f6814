"""Session runtime safety on the real default model, past eviction (sink 4, window 60).

A stream commits exactly the tokens it delivered (stop by break, close(), garbage
collection, at any event kind, plain and speculative, greedy and sampled), less a last one
its consumer retracts (and the served metric never counts that one); locks are per
session and never held across a yield; one generation at a time per session; append is
all-or-nothing under an interrupt; close / LRU eviction / idle expiry of a streaming
session end its stream with SessionClosed.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from kakeya_lab import SinkWindowConfig
from kakeya_lab.proposers import DraftModelProposer, EarlyExitProposer, NgramProposer
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.serve.admission import Admission
from kakeya_lab.serve.sessions import GenerateOptions, ServedSessions
from kakeya_lab.session import (
    ChatTurn,
    Done,
    HistoryTruncated,
    SessionBusy,
    SessionClosed,
    SessionStore,
    SpeculativeStep,
    Token,
)

CONFIG = SinkWindowConfig(sink=4, window=60)
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def prompt(text_ids):
    return text_ids[:90]  # longer than sink + window: the prefill itself evicts


def _store(default_model, **kw):
    return SessionStore(default_model.model, CONFIG, **kw)


def _greedy_reply(store, sid, n=4):
    return [e.id for e in store.generate(sid, n) if isinstance(e, Token)]


def _assert_same_as_clean(default_model, store, sid, history):
    """The session equals a clean session that appended ``history``: ids, cache, logits,
    and its next greedy reply."""
    clean = _store(default_model)
    cid = clean.create()
    clean.append(cid, history)
    v, cv = store.verifier(sid), clean.verifier(cid)
    assert v.history_token_ids == history
    assert v.cached_token_ids == cv.cached_token_ids
    assert v.history_len > CONFIG.budget
    diff = (store.next_token_logits(sid) - clean.next_token_logits(cid)).abs().max().item()
    assert diff <= LOGIT_TOL
    assert _greedy_reply(store, sid) == _greedy_reply(clean, cid)


MODES = {
    "plain-greedy": dict(),
    "plain-sampled": dict(sampling=SamplingConfig(temperature=0.9, seed=3)),
    "early-exit-greedy": dict(proposer="early-exit"),
    "early-exit-sampled": dict(
        proposer="early-exit", sampling=SamplingConfig(temperature=0.9, seed=3)
    ),
    "self-draft-greedy": dict(proposer="self-draft"),
}


def _options(kind, default_model):
    options = dict(MODES[kind])
    name = options.pop("proposer", None)
    if name == "early-exit":
        options["proposer"] = EarlyExitProposer(default_model.model, CONFIG, num_layers=6)
    elif name == "self-draft":  # every draft accepted: a stop lands inside a long step
        options["proposer"] = DraftModelProposer(default_model.model, CONFIG)
    return options


STOPS = [
    ("plain-greedy", "break"),
    ("plain-sampled", "close"),
    ("early-exit-greedy", "close"),
    ("early-exit-sampled", "break"),
    ("self-draft-greedy", "close"),
]


@pytest.mark.parametrize(("kind", "how"), STOPS)
@pytest.mark.slow
def test_stop_commits_exactly_the_delivered_tokens(default_model, prompt, kind, how):
    store = _store(default_model)
    sid = store.create()
    store.append(sid, prompt)
    options = _options(kind, default_model)
    delivered = []
    stream = store.generate(sid, 20, draft_length=4, **options)
    for event in stream:
        if isinstance(event, Token):
            delivered.append(event.id)
            if len(delivered) == 3:
                break
    if how == "close":
        stream.close()
        stream.close()  # idempotent
    del stream
    assert len(delivered) == 3
    assert store.info(sid).generated_tokens == 3
    _assert_same_as_clean(default_model, store, sid, prompt + delivered)
    if "proposer" in options:  # the proposer resynchronises: the next turn stays lossless
        store.append(sid, [42, 43])
        clean = _store(default_model)
        cid = clean.create()
        clean.append(cid, store.verifier(sid).history_token_ids)
        got = [
            e.id
            for e in store.generate(sid, 8, proposer=options["proposer"])
            if isinstance(e, Token)
        ]
        assert got == _greedy_reply(clean, cid, 8)


@pytest.mark.parametrize("stop_at", [SpeculativeStep, HistoryTruncated])
@pytest.mark.slow
def test_stop_at_a_non_token_event_keeps_only_delivered_tokens(default_model, text_ids, stop_at):
    store = _store(default_model)
    sid = store.create()
    start = text_ids[:58]  # below the budget: truncation starts during the reply
    store.append(sid, start)
    proposer = DraftModelProposer(default_model.model, CONFIG)
    delivered = []
    stream = store.generate(sid, 30, proposer=proposer, draft_length=4)
    seen = 0
    for event in stream:
        if isinstance(event, Token):
            delivered.append(event.id)
        if isinstance(event, stop_at):
            seen += 1
            if stop_at is HistoryTruncated or seen == 2:
                break
    stream.close()
    assert delivered  # stopped part-way, after some tokens
    if stop_at is HistoryTruncated:
        assert len(start) + len(delivered) == CONFIG.budget  # the next token would evict
    v = store.verifier(sid)
    assert v.history_token_ids == start + delivered and v.pending_len == 0
    # the generation continues from exactly the delivered history
    clean = _store(default_model)
    cid = clean.create()
    clean.append(cid, start + delivered)
    diff = (store.next_token_logits(sid) - clean.next_token_logits(cid)).abs().max().item()
    assert diff <= LOGIT_TOL
    assert _greedy_reply(store, sid, 12) == _greedy_reply(clean, cid, 12)
    assert store.verifier(sid).history_len > CONFIG.budget


RETRACTS = [
    ("plain-greedy", "close"),
    ("early-exit-greedy", "close"),
    ("plain-sampled", "resume"),
    ("early-exit-sampled", "resume"),
]


@pytest.mark.parametrize(("kind", "then"), RETRACTS)
@pytest.mark.slow
def test_a_retracted_token_is_not_kept(default_model, prompt, kind, then):
    """A consumer that could not pass the third token on retracts it (through the chat
    turn, as a server does). Closed then, the session keeps the first two and equals a clean
    session of them; resumed, the next event offers the same token again and the reply is
    the one no retraction made."""
    store = _store(default_model)

    def reply(retract_at: int | None) -> tuple[str, list[int]]:
        sid = store.create()
        store.append(sid, prompt)
        stream = store.generate(sid, 6, draft_length=4, **_options(kind, default_model))
        turn = ChatTurn(stream, None, store.eos_token_ids)
        assert not turn.retract()  # nothing handed out yet
        got = []
        for event in turn:
            if isinstance(event, Token):
                got.append(event.id)
                if len(got) == retract_at:
                    assert turn.retract() and not turn.retract()
                    assert turn.token_ids == got[:-1]
                    got.pop()
                    retract_at = None
                    if then == "close":
                        turn.close()
        assert turn.token_ids == got
        return sid, got

    sid, got = reply(3)
    assert store.verifier(sid).history_token_ids == prompt + got
    if then == "close":
        assert len(got) == 2 and store.info(sid).generated_tokens == 2
        _assert_same_as_clean(default_model, store, sid, prompt + got)
    else:
        assert got == reply(None)[1]
        assert store.info(sid).generated_tokens == len(got) == 6


@pytest.mark.parametrize("then", ["close", "resume"])
def test_the_served_token_metric_counts_only_kept_tokens(default_model, prompt, then):
    """Through the serving layer, as the HTTP front end retracts a token its client never
    got: the generated-tokens metric equals what the session kept, never one more."""
    served = ServedSessions(
        _store(default_model), default_model.tokenizer, Admission("reject", 0.0)
    )
    session, _ = served.create(origin="http")
    served.append_ids(session.id, prompt)
    options = GenerateOptions(max_new_tokens=5, allow_no_stop=True)
    with served.generate(session.id, options) as stream:
        for _ in range(3):
            assert isinstance(next(stream), Token)
        assert stream.retract()
        if then == "resume":
            events = list(stream)
    kept = served.info(session.id)["generated_tokens"]
    assert kept == (2 if then == "close" else 5)
    if then == "resume":
        assert sum(isinstance(e, Token) for e in events) == 3 and isinstance(events[-1], Done)
    assert served.metrics.registry.get_sample_value("kakeya_generated_tokens_total") == kept


def test_garbage_collected_and_unstarted_streams_are_clean(default_model, prompt):
    store = _store(default_model)
    sid = store.create()
    store.append(sid, prompt)
    stream = store.generate(sid, 10, proposer=NgramProposer())
    got = [next(stream) for _ in range(4)]
    delivered = [e.id for e in got if isinstance(e, Token)]
    del stream, got
    gc.collect()
    assert store.verifier(sid).history_token_ids == prompt + delivered
    unstarted = store.generate(sid, 5)
    with pytest.raises(SessionBusy):
        store.append(sid, [1])
    del unstarted
    store.append(sid, [1])  # no longer busy; nothing was generated
    assert store.verifier(sid).history_token_ids == prompt + delivered + [1]


def test_one_generation_at_a_time_per_session(default_model, prompt):
    store = _store(default_model)
    sid = store.create()
    store.append(sid, prompt)
    stream = store.generate(sid, 8)
    first = next(stream)
    with pytest.raises(SessionBusy, match="close()"):
        store.generate(sid, 4)
    with pytest.raises(SessionBusy, match="open generation stream"):
        store.append(sid, [5, 6])
    rest = list(stream)  # the open stream is undisturbed
    tokens = [e.id for e in [first, *rest] if isinstance(e, Token)]
    assert isinstance(rest[-1], Done) and rest[-1].counts.generated_tokens == len(tokens) == 8
    assert store.verifier(sid).history_token_ids == prompt + tokens
    store.append(sid, [5, 6])  # free again


def test_a_paused_stream_blocks_no_other_session(default_model, prompt):
    store = _store(default_model, capacity=4)
    a = store.create()
    store.append(a, prompt)
    paused = store.generate(a, 20)
    next(paused)  # holds no lock while paused; never closed in this test
    results = {}

    def other():
        b = store.create()
        store.append(b, prompt[:20])
        results["reply"] = _greedy_reply(store, b, 5)
        results["info_a"] = store.info(a).history_len  # reading the paused session too
        store.close(b)

    worker = threading.Thread(target=other, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the store blocked while another session's stream was paused"
    assert len(results["reply"]) == 5 and results["info_a"] == len(prompt)
    paused.close()


def test_append_is_all_or_nothing_under_keyboard_interrupt(default_model, prompt, text_ids):
    model = default_model.model
    store = SessionStore(model, CONFIG, prefill_chunk=8)
    sid = store.create()
    store.append(sid, prompt)
    before_ids = store.verifier(sid).history_token_ids
    before_cached = store.verifier(sid).cached_token_ids
    before_logits = store.next_token_logits(sid)
    before_info = store.info(sid)
    calls = {"n": 0}

    def interrupt_in_second_chunk(_module, _inputs, _output):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    hook = model.model.layers[3].mlp.down_proj.register_forward_hook(interrupt_in_second_chunk)
    try:
        with pytest.raises(KeyboardInterrupt):
            store.append(sid, text_ids[100:130])  # four chunks of 8
    finally:
        hook.remove()
    v = store.verifier(sid)
    assert calls["n"] == 2
    assert v.history_token_ids == before_ids and v.cached_token_ids == before_cached
    assert torch.equal(store.next_token_logits(sid), before_logits)
    after = store.info(sid)
    assert (after.turns, after.last_used_s) == (before_info.turns, before_info.last_used_s)
    _assert_same_as_clean(default_model, store, sid, prompt)


@pytest.mark.parametrize("interrupts", ["once", "repeatedly"])
@pytest.mark.slow
def test_interrupt_inside_a_speculative_step_keeps_delivered_tokens(
    default_model, prompt, interrupts
):
    """Interrupted during the next step; "repeatedly" also interrupts the commit of the last
    delivered token in the stream's cleanup (it is then appended by the next call)."""
    model = default_model.model
    store = _store(default_model)
    sid = store.create()
    store.append(sid, prompt)
    proposer = DraftModelProposer(model, CONFIG)
    delivered = []
    stream = store.generate(sid, 30, proposer=proposer, draft_length=4)
    for event in stream:
        if isinstance(event, Token):
            delivered.append(event.id)
            if len(delivered) == 6:
                break
    calls = {"n": 0}

    def interrupt(_module, _inputs, _output):
        calls["n"] += 1
        if calls["n"] == 1 or interrupts == "repeatedly":
            raise KeyboardInterrupt

    hook = model.model.layers[3].mlp.down_proj.register_forward_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            next(stream)  # the next step's forward (draft or verifier) is interrupted
    finally:
        hook.remove()
    assert calls["n"] >= 1
    with pytest.raises(StopIteration):
        next(stream)
    store.append(sid, [7])  # not busy any more
    _assert_same_as_clean(default_model, store, sid, prompt + delivered + [7])


def _paused_stream(store, sid, prompt):
    store.append(sid, prompt)
    stream = store.generate(sid, 20)
    first = next(stream)
    assert isinstance(first, Token)
    return stream


def test_close_while_streaming_ends_the_stream_with_session_closed(default_model, prompt):
    store = _store(default_model, capacity=3)
    a, b = store.create(), store.create()
    stream = _paused_stream(store, a, prompt)
    store.append(b, prompt[5:])
    store.close(a)
    with pytest.raises(SessionClosed, match="closed while generating"):
        next(stream)
    with pytest.raises(StopIteration):
        next(stream)
    stream.close()
    assert store.ids() == [b]
    _assert_same_as_clean(default_model, store, b, prompt[5:])


def test_lru_eviction_while_streaming(default_model, prompt):
    store = _store(default_model, capacity=2, policy="evict_lru")
    a, b = store.create(), store.create()
    stream = _paused_stream(store, a, prompt)
    store.append(b, prompt[5:])  # b is now the most recently used
    c = store.create()
    assert set(store.ids()) == {b, c}
    with pytest.raises(SessionClosed, match="least recently used"):
        next(stream)
    _assert_same_as_clean(default_model, store, b, prompt[5:])


def test_idle_expiry_while_paused_but_never_while_streaming(default_model, prompt):
    store = _store(default_model, capacity=3, idle_ttl_s=0.4)
    a = store.create()
    stream = _paused_stream(store, a, prompt)
    events = [next(stream)]
    time.sleep(0.6)  # the consumer stopped asking: the session is idle
    assert store.ids() == []
    with pytest.raises(SessionClosed, match="idle"):
        next(stream)
    del events
    # a stream that keeps being consumed is never expired, even with a poller at work
    b = store.create()
    store.append(b, prompt)
    stop = threading.Event()
    seen_missing = []

    def poll():
        while not stop.is_set():
            if b not in store.ids():
                seen_missing.append(True)
            time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.monotonic()
    try:
        events = list(store.generate(b, 24))
    finally:
        stop.set()
        poller.join(timeout=10)
    assert time.monotonic() - t0 > 0.4  # the stream outlived the TTL
    assert not seen_missing and isinstance(events[-1], Done)
    assert events[-1].counts.generated_tokens == 24


def test_stop_button_from_another_thread_mid_stream(default_model, prompt):
    """A UI thread closes the stream while the consumer thread is pulling events."""
    store = _store(default_model)
    sid = store.create()
    store.append(sid, prompt)
    stream = store.generate(
        sid, 200, proposer=EarlyExitProposer(default_model.model, CONFIG, num_layers=6)
    )
    delivered = []
    started = threading.Event()

    def consume():
        for event in stream:
            if isinstance(event, Token):
                delivered.append(event.id)
                started.set()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert started.wait(timeout=60)
    stream.close()  # the Stop button
    consumer.join(timeout=60)
    assert not consumer.is_alive()
    assert 1 <= len(delivered) < 200
    _assert_same_as_clean(default_model, store, sid, prompt + delivered)
