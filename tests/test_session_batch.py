"""A batched session store (``SessionStore(batch=True)``): sessions generating in threads
share forwards, and each one's greedy reply is its solo run's (plain and speculative,
past eviction); closing a stream early and closing a session keep their
semantics while other sessions keep generating. The oracle agreement of the batched
forward is tests/test_torch_batch.py's; its speed is benchmarks/batch_scaling.py's."""

from __future__ import annotations

import threading

import pytest

from kakeya_lab import SinkWindowConfig
from kakeya_lab.proposers import NgramProposer
from kakeya_lab.session import SessionStore, Token, UnknownSession, collect_reply
from kakeya_lab.session.errors import SessionClosed

CONFIG = SinkWindowConfig(sink=4, window=60)


def _run_threads(target, n: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a generating thread is stuck"
    return errors


@pytest.mark.slow  # 30 s (the solo runs, then the batched ones)
def test_concurrent_sessions_in_a_batched_store_reply_as_they_do_alone(default_model, text_ids):
    """Four sessions of the default model (prompts of 10 to 90 tokens, replies that outgrow
    a 4 + 60 cache; one decodes speculatively with an n-gram proposer), two turns each,
    generated in four threads through one batched store: every reply is the session's
    solo reply, and the forwards carried several rows."""
    model = default_model.model
    prompts = [text_ids[:10], text_ids[20:60], text_ids[50:140], text_ids[100:170]]
    follow = [text_ids[200 + 5 * i : 208 + 5 * i] for i in range(4)]
    speculative = [False, True, False, False]

    def converse(store: SessionStore, i: int) -> list[list[int]]:
        sid = store.create()
        replies = []
        for turn in (prompts[i], follow[i]):
            store.append(sid, turn)
            proposer = NgramProposer() if speculative[i] else None
            replies.append(collect_reply(store.generate(sid, 24, proposer=proposer)).token_ids)
        assert store.info(sid).history_len > CONFIG.budget
        return replies

    solo_store = SessionStore(model, CONFIG, capacity=4, eos_token_ids=[])
    solo = [converse(solo_store, i) for i in range(4)]
    store = SessionStore(model, CONFIG, capacity=4, eos_token_ids=[], batch=True)
    got: list[list[list[int]] | None] = [None] * 4

    def work(i: int) -> None:
        got[i] = converse(store, i)

    assert not _run_threads(work, 4)
    assert got == solo
    assert store.batcher is not None
    assert store.batcher.forward.rows > 1.5 * store.batcher.forward.forwards


def test_stopping_and_closing_keep_their_semantics_in_a_batch(tiny_model):
    """Among sessions generating together: one stream closed after 5 tokens keeps exactly
    those 5; a session closed by another thread ends its stream with SessionClosed; the
    others finish their replies, equal to their solo runs."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=12)
    store = SessionStore(model, config, capacity=8, eos_token_ids=[], batch=True)
    prompts = [[11 + i, 40 + 3 * i, 7, 99 + i] for i in range(4)]
    sids = []
    for p in prompts:
        sid = store.create()
        store.append(sid, p)
        sids.append(sid)
    solo = SessionStore(model, config, capacity=8, eos_token_ids=[])
    want = []
    for p in prompts:
        s = solo.create()
        solo.append(s, p)
        want.append(collect_reply(solo.generate(s, 40)).token_ids)
    got: dict[int, list[int]] = {}
    closing, closed = threading.Event(), threading.Event()
    outcomes: dict[int, str] = {}

    def work(i: int) -> None:
        if i == 4:  # closes session 3 while it generates
            closing.wait(timeout=60)
            store.close(sids[3])
            closed.set()
            return
        stream = store.generate(sids[i], 40)
        tokens = []
        try:
            for event in stream:
                if isinstance(event, Token):
                    tokens.append(event.id)
                    if i == 3 and len(tokens) == 3:
                        closing.set()
                        closed.wait(timeout=60)  # its consumer asks again only then
                    if i == 2 and len(tokens) == 5:
                        stream.close()
                        break
        except SessionClosed:
            outcomes[i] = "closed"
        got[i] = tokens

    assert not _run_threads(work, 5)
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2] == want[2][:5]
    assert store.info(sids[2]).generated_tokens == 5
    assert store.verifier(sids[2]).history_token_ids == prompts[2] + want[2][:5]
    assert outcomes.get(3) == "closed" and got[3] == want[3][:3]
    with pytest.raises(UnknownSession, match="closed"):
        store.info(sids[3])
    # the stopped session goes on as a solo one would
    s = solo.create()
    solo.append(s, prompts[2])
    solo_stream = solo.generate(s, 5)
    assert [e.id for e in solo_stream if isinstance(e, Token)] == want[2][:5]
    assert (
        collect_reply(store.generate(sids[2], 6)).token_ids
        == collect_reply(solo.generate(s, 6)).token_ids
    )


def test_a_batched_store_needs_a_model_the_batched_forward_runs(tiny_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="batch=True needs a torch Llama"):
        SessionStore(gpt2, SinkWindowConfig(sink=2, window=12), batch=True)
