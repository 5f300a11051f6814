"""Session store: lifecycle, policies, bad input, isolation, events, chat templating."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from kakeya_lab import SinkWindowCache, SinkWindowConfig, Verifier
from kakeya_lab.backends.torch_cache import cache_kwarg
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.session import (
    CapacityExceeded,
    Done,
    HistoryTruncated,
    SessionError,
    SessionStore,
    Token,
    UnknownSession,
    collect_reply,
)

CONFIG = SinkWindowConfig(sink=2, window=12)


@pytest.fixture
def store(tiny_model):
    return SessionStore(tiny_model.model, CONFIG, capacity=2, policy="reject")


def test_capacity_reject_and_lru_eviction(tiny_model):
    store = SessionStore(tiny_model.model, CONFIG, capacity=2, policy="reject")
    a, b = store.create(), store.create()
    assert a != b
    with pytest.raises(CapacityExceeded):
        store.create()
    lru = SessionStore(tiny_model.model, CONFIG, capacity=2, policy="evict_lru")
    a, b = lru.create(), lru.create()
    lru.append(a, [1, 2])  # a is now the most recently used
    c = lru.create()
    assert set(lru.ids()) == {a, c}
    with pytest.raises(UnknownSession, match="least recently used"):
        lru.info(b)


def test_reading_a_session_counts_as_use(tiny_model):
    lru = SessionStore(tiny_model.model, CONFIG, capacity=2, policy="evict_lru")
    a, b = lru.create(), lru.create()
    lru.info(a)  # a is now the most recently used: b goes first
    c = lru.create()
    assert set(lru.ids()) == {a, c} and b not in lru.ids()
    lru.append(a, [1, 2])
    lru.next_token_logits(c)  # c is now the most recently used: a goes first
    d = lru.create()
    assert set(lru.ids()) == {c, d}


def test_a_session_id_of_the_wrong_type_is_a_clear_error(store):
    for bad in (["a"], 3, None):
        with pytest.raises(TypeError, match="a session id is a string"):
            store.info(bad)
    with pytest.raises(TypeError, match="a session id is a string"):
        store.append({"id": 1}, [1])


def test_idle_ttl_evicts(tiny_model):
    # margins of a second either way, so a busy machine's pauses decide nothing
    store = SessionStore(tiny_model.model, CONFIG, capacity=4, idle_ttl_s=2.0)
    a = store.create()
    b = store.create()
    store.append(b, [5])
    time.sleep(1.0)
    store.append(b, [6])  # keeps b alive
    time.sleep(1.2)
    assert store.ids() == [b]
    with pytest.raises(UnknownSession, match="idle"):
        store.append(a, [1])


def test_unknown_empty_oov_and_double_close(store):
    with pytest.raises(UnknownSession):
        store.append("nope", [1])
    sid = store.create()
    with pytest.raises(SessionError, match="empty"):
        store.generate(sid, 3)
    with pytest.raises(ValueError, match="empty"):
        store.append(sid, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        store.append(sid, [1, 10**9])
    assert store.info(sid).history_len == 0
    store.append(sid, [1, 2, 3])
    for bad in [
        lambda: store.generate(sid, 0),
        lambda: store.generate(sid, 2, SamplingConfig(temperature=-1.0)),
        lambda: store.generate(sid, 2, SamplingConfig(temperature=1.0, top_p=0.0)),
    ]:
        with pytest.raises(ValueError):
            bad()
    assert store.info(sid).history_len == 3
    store.close(sid)
    with pytest.raises(UnknownSession, match="closed"):
        store.close(sid)


def test_interleaved_sessions_never_disturb_each_other(tiny_model):
    model = tiny_model.model
    store = SessionStore(model, CONFIG, capacity=4)
    rng = random.Random(3)
    turns = [[rng.randrange(1000) for _ in range(rng.randint(2, 7))] for _ in range(8)]
    a, b = store.create(), store.create()
    out = {a: [], b: []}
    for i, turn in enumerate(turns):
        for sid, shift in ((a, 0), (b, 1)):
            store.append(sid, [t + shift for t in turn])
            out[sid] += [e.id for e in store.generate(sid, 4) if isinstance(e, Token)]
        assert i < 2 or store.info(a).cache_len == CONFIG.budget
    # each session alone gives the same tokens
    for sid, shift in ((a, 0), (b, 1)):
        solo = SessionStore(model, CONFIG)
        s = solo.create()
        toks = []
        for turn in turns:
            solo.append(s, [t + shift for t in turn])
            toks += [e.id for e in solo.generate(s, 4) if isinstance(e, Token)]
        assert toks == out[sid]


def test_generate_events_and_truncation(tiny_model):
    store = SessionStore(tiny_model.model, CONFIG)
    sid = store.create()
    store.append(sid, list(range(10, 20)))
    events = list(store.generate(sid, 8))
    truncations = [e for e in events if isinstance(e, HistoryTruncated)]
    assert len(truncations) == 1 and truncations[0].dropped > 0
    tokens = [e for e in events if isinstance(e, Token)]
    done = events[-1]
    assert isinstance(done, Done) and done.stop_reason == "max_tokens"
    assert done.counts.generated_tokens == len(tokens) == 8
    assert done.counts.history_len == 18 and done.counts.cache_len == CONFIG.budget
    assert done.counts.to_dict()["generated_tokens"] == 8 and done.timings.total_s > 0
    # a later call: truncation was already reported for this history, not again
    assert not [e for e in store.generate(sid, 3) if isinstance(e, HistoryTruncated)]


def test_stop_tokens_and_seeded_sampling(tiny_model):
    store = SessionStore(tiny_model.model, CONFIG, capacity=4)

    def run(seed):
        sid = store.create()
        store.append(sid, [1, 2, 3])
        toks = [
            e.id
            for e in store.generate(sid, 12, SamplingConfig(temperature=1.0, seed=seed, top_k=50))
            if isinstance(e, Token)
        ]
        store.close(sid)
        return toks

    assert run(7) == run(7)
    assert run(7) != run(8)
    sid = store.create()
    store.append(sid, [1, 2, 3])
    greedy = [e.id for e in store.generate(sid, 6) if isinstance(e, Token)]
    sid2 = store.create()
    store.append(sid2, [1, 2, 3])
    events = list(store.generate(sid2, 6, stop_token_ids=[greedy[2]]))
    assert [e.id for e in events if isinstance(e, Token)] == greedy[: greedy.index(greedy[2]) + 1]
    assert events[-1].stop_reason == "stop"


def test_chunking_invariance(tiny_model):
    rng = random.Random(11)
    ids = [rng.randrange(2000) for _ in range(60)]
    ref = Verifier(tiny_model.model, CONFIG).append(ids)
    for _ in range(3):
        v = Verifier(tiny_model.model, CONFIG)
        i = 0
        while i < len(ids):
            k = rng.randint(1, 11)
            last = v.append(ids[i : i + k])
            i += k
        assert (last - ref).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_model_generate_with_our_cache_matches_verifier_greedy(default_model, text_ids):
    model = default_model.model
    config = SinkWindowConfig(sink=4, window=44)
    prompt = text_ids[:70]  # longer than the budget: the prefill itself must evict
    cache = SinkWindowCache(model, config)
    out = model.generate(
        torch.tensor([prompt]),
        **cache_kwarg(model, cache),  # cache= from transformers 5.24, past_key_values= before
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    generated = out[0, len(prompt) :].tolist()
    v = Verifier(model, config)
    logits = v.append(prompt)
    ours = []
    for _ in range(30):
        t = int(logits.argmax())
        ours.append(t)
        logits = v.append([t])
    assert generated == ours
    assert cache.cache_len == config.budget and cache.next_position == len(prompt) + 29


def test_chat_template_deltas_concatenate_to_the_whole_conversation(default_model):
    tok = default_model.tokenizer
    chat = ChatTemplate(tok)
    ids = []
    script = [
        ("Hi! How are you today?", "I'm well, thanks. How can I help?"),
        ("Tell me about lighthouses.", "They guide ships with light."),
        ("And foghorns?", "They sound when it is foggy."),
    ]
    for user, reply in script:
        ids += chat.user(user)
        assert ids == chat.full_ids(add_generation_prompt=True)
        ids += chat.assistant(reply)
        assert ids == chat.full_ids(add_generation_prompt=False)
    ids += chat.user("Thanks, bye!")
    text = tok.apply_chat_template(chat.messages, tokenize=False, add_generation_prompt=True)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_chat_with_generated_replies_in_a_session(default_model):
    tok = default_model.tokenizer
    store = SessionStore(default_model.model, SinkWindowConfig(sink=4, window=60))
    sid = store.create()
    chat = ChatTemplate(tok)
    for user in ["Hello!", "What is two plus two?", "Thanks."]:
        store.append(sid, chat.user(user))
        reply = [e.id for e in store.generate(sid, 12) if isinstance(e, Token)]
        chat.generated(reply, eos_token_ids=store.eos_token_ids)
    v = store.verifier(sid)
    assert tok.decode(v.history_token_ids, skip_special_tokens=False) == chat.rendered
    assert v.history_len > 60 and v.cache_len == 64


@pytest.mark.slow
def test_probe_is_a_rolled_back_side_question_past_eviction(default_model, text_ids):
    config = SinkWindowConfig(sink=4, window=60)
    store = SessionStore(default_model.model, config)
    sid = store.create()
    history = text_ids[:90]
    store.append(sid, history)
    v = store.verifier(sid)
    before = (
        v.history_token_ids,
        v.cached_token_ids,
        store.next_token_logits(sid),
        store.info(sid).turns,
    )
    question = text_ids[100:110]
    answer = store.probe(sid, question, 8)
    after = (
        v.history_token_ids,
        v.cached_token_ids,
        store.next_token_logits(sid),
        store.info(sid).turns,
    )
    assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and before[3] == after[3]
    assert v.pending_len == 0 and v.history_len > config.budget
    # the answer is the greedy reply of a session that really appended the question
    other = store.create()
    store.append(other, history + question)
    assert answer == collect_reply(store.generate(other, 8)).token_ids
    # and the probed session continues as if nothing happened
    clean = store.create()
    store.append(clean, history)
    assert (
        collect_reply(store.generate(sid, 6)).token_ids
        == collect_reply(store.generate(clean, 6)).token_ids
    )


def test_collect_reply_and_typed_records(tiny_model):
    store = SessionStore(tiny_model.model, CONFIG)
    sid = store.create()
    store.append(sid, list(range(10, 20)))
    reply = collect_reply(store.generate(sid, 8))
    assert len(reply.token_ids) == reply.done.counts.generated_tokens == 8
    assert reply.truncated_dropped == 1  # the 5th token makes the history 15 > budget 14
    assert reply.steps == [] and reply.done.counts.tau == 1.0
    info = store.info(sid)
    assert info.speculative.steps == 0 and info.to_dict()["speculative"]["tau"] is None
    stream = store.generate(sid, 4)
    next(stream)
    stream.close()
    with pytest.raises(SessionError, match="without a Done"):
        collect_reply(stream)


def test_chat_template_fork_and_state_round_trip(default_model):
    tok = default_model.tokenizer
    chat = ChatTemplate(tok, system="Be brief.")
    ids = chat.user("Hello!") + chat.assistant("Hi.")
    side = chat.fork()
    side_ids = side.user("A side question?")
    assert chat.messages[-1]["content"] == "Hi." and not chat.awaiting_reply
    assert side_ids == chat.fork().user("A side question?")
    resumed = ChatTemplate.from_state(tok, json.loads(json.dumps(chat.to_state())))
    assert resumed.user("Next?") == chat.user("Next?")
    assert ids + resumed.full_ids()[len(ids) :] == chat.full_ids()
    with pytest.raises(ValueError, match="to_state"):
        ChatTemplate.from_state(tok, {"messages": []})
