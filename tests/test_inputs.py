"""One input policy (kakeya_lab.inputs): every bad argument is refused before any state
changes, with a message that names the argument and what was given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kakeya_lab import SinkWindowConfig, Verifier, inputs
from kakeya_lab.proposers import NgramProposer, make_proposer
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.session import SessionStore, Token
from kakeya_lab.speculative import plain_decode

CONFIG = SinkWindowConfig(sink=2, window=12)


def _cases(store, sid, model, vocab):
    gen = store.generate
    return [
        # token ids
        (
            "float id",
            lambda: store.append(sid, [1, 1.5]),
            TypeError,
            "must be an integer, got float 1.5",
        ),
        (
            "bool id",
            lambda: store.append(sid, [True]),
            TypeError,
            "must be an integer, got bool True",
        ),
        ("string ids", lambda: store.append(sid, "hello"), TypeError, "not a str"),
        (
            "2-D tensor",
            lambda: store.append(sid, torch.tensor([[1, 2]])),
            ValueError,
            "must be 1-D",
        ),
        ("2-D array", lambda: store.append(sid, np.array([[1, 2]])), ValueError, "must be 1-D"),
        (
            "float tensor",
            lambda: store.append(sid, torch.tensor([1.0])),
            TypeError,
            "integer tensor",
        ),
        ("empty ids", lambda: store.append(sid, []), ValueError, "empty"),
        ("id past vocab", lambda: store.append(sid, [vocab]), ValueError, "outside the vocabulary"),
        (
            "np id past vocab",
            lambda: store.append(sid, [np.int64(vocab)]),
            ValueError,
            "outside the vocabulary",
        ),
        ("negative id", lambda: store.append(sid, [-1]), ValueError, "outside the vocabulary"),
        ("int, not ids", lambda: store.append(sid, 5), TypeError, "sequence of integers"),
        # counts and sampling
        (
            "bool max_new",
            lambda: gen(sid, True),
            TypeError,
            "max_new_tokens must be an integer, got bool",
        ),
        (
            "float max_new",
            lambda: gen(sid, 2.0),
            TypeError,
            "max_new_tokens must be an integer, got float",
        ),
        ("zero max_new", lambda: gen(sid, 0), ValueError, "max_new_tokens must be >= 1"),
        (
            "zero draft",
            lambda: gen(sid, 3, proposer=NgramProposer(), draft_length=0),
            ValueError,
            "draft_length must be >= 1",
        ),
        (
            "float draft",
            lambda: gen(sid, 3, proposer=NgramProposer(), draft_length=1.5),
            TypeError,
            "draft_length must be an",
        ),
        (
            "bool top_k",
            lambda: gen(sid, 3, SamplingConfig(temperature=1.0, top_k=True)),
            TypeError,
            "top_k must be an integer",
        ),
        (
            "top_p 0",
            lambda: gen(sid, 3, SamplingConfig(temperature=1.0, top_p=0.0)),
            ValueError,
            "top_p must be > 0",
        ),
        (
            "top_p 2",
            lambda: gen(sid, 3, SamplingConfig(temperature=1.0, top_p=2.0)),
            ValueError,
            "top_p must be in (0, 1]",
        ),
        (
            "text temperature",
            lambda: gen(sid, 3, SamplingConfig(temperature="hot")),
            TypeError,
            "temperature must be a number",
        ),
        (
            "negative temperature",
            lambda: gen(sid, 3, SamplingConfig(temperature=-1.0)),
            ValueError,
            "temperature must be >= 0",
        ),
        (
            "a temperature that overflows the logits",
            lambda: gen(sid, 3, SamplingConfig(temperature=1e-45)),
            ValueError,
            "0 (greedy) or at least",
        ),
        (
            "nan temperature",
            lambda: gen(sid, 3, SamplingConfig(temperature=float("nan"))),
            ValueError,
            "finite",
        ),
        (
            "float seed",
            lambda: gen(sid, 3, SamplingConfig(temperature=1.0, seed=1.5)),
            TypeError,
            "seed must be an integer",
        ),
        (
            "string stops",
            lambda: gen(sid, 3, stop_token_ids="ab"),
            TypeError,
            "stop_token_ids must be a collection",
        ),
        (
            "float stop",
            lambda: gen(sid, 3, stop_token_ids=[2.5]),
            TypeError,
            "must be an integer, got float 2.5",
        ),
        ("string proposer", lambda: gen(sid, 3, proposer="ngram"), TypeError, "make_proposer"),
        ("dict sampling", lambda: gen(sid, 3, {"temperature": 1.0}), TypeError, "SamplingConfig"),
        ("not a proposer", lambda: gen(sid, 3, proposer=object()), TypeError, "Proposer protocol"),
        (
            "decoder bool max",
            lambda: plain_decode(store.verifier(sid), torch.zeros(vocab), max_new_tokens=True),
            TypeError,
            "max_new_tokens must be an integer",
        ),
        # store and cache configuration
        (
            "float capacity",
            lambda: SessionStore(model, CONFIG, capacity=1.5),
            TypeError,
            "capacity must be an integer",
        ),
        (
            "zero capacity",
            lambda: SessionStore(model, CONFIG, capacity=0),
            ValueError,
            "capacity must be >= 1",
        ),
        (
            "bool chunk",
            lambda: SessionStore(model, CONFIG, prefill_chunk=True),
            TypeError,
            "prefill_chunk must be",
        ),
        (
            "zero chunk",
            lambda: SessionStore(model, CONFIG, prefill_chunk=0),
            ValueError,
            "prefill_chunk must be >= 1",
        ),
        ("zero ttl", lambda: SessionStore(model, CONFIG, idle_ttl_s=0), ValueError, "idle_ttl_s"),
        (
            "huge window",
            lambda: SinkWindowConfig(sink=4, window=2**70),
            ValueError,
            "larger than any machine",
        ),
        (
            "huge sink",
            lambda: SinkWindowConfig(sink=2**40, window=8),
            ValueError,
            "larger than any machine",
        ),
        (
            "bool sink",
            lambda: SinkWindowConfig(sink=True),
            TypeError,
            "sink must be an integer, got bool",
        ),
        (
            "float window",
            lambda: SinkWindowConfig(window=1.5),
            TypeError,
            "window must be an integer, got float",
        ),
        ("zero window", lambda: SinkWindowConfig(window=0), ValueError, "window must be >= 1"),
        ("bad positions", lambda: SinkWindowConfig(positions="absolute"), ValueError, "positions"),
        # proposers
        (
            "float ngram size",
            lambda: NgramProposer([2, 1.5]),
            TypeError,
            "n-gram size must be an integer",
        ),
        ("string ngram sizes", lambda: NgramProposer("32"), TypeError, "ngram_sizes"),
        (
            "bad ngram spec",
            lambda: make_proposer("ngram:a", model, CONFIG),
            ValueError,
            "ngram:3,2,1",
        ),
        (
            "unknown spec",
            lambda: make_proposer("magic", model, CONFIG),
            ValueError,
            "unknown proposer",
        ),
        ("spec not a string", lambda: make_proposer(3, model, CONFIG), TypeError, "string or None"),
        (
            "early exit layers",
            lambda: make_proposer("early-exit:9", model, CONFIG),
            ValueError,
            "num_layers",
        ),
        (
            "bool count",
            lambda: inputs.count(True, "n"),
            TypeError,
            "n must be an integer, got bool True",
        ),
        (
            "float count",
            lambda: inputs.count(1.5, "n"),
            TypeError,
            "n must be an integer, got float 1.5",
        ),
    ]


def _state(store, sid):
    v = store.verifier(sid)
    info = store.info(sid)
    return (
        v.history_token_ids,
        v.cached_token_ids,
        v.pending_len,
        info.turns,
        info.generated_tokens,
        info.last_used_s,
        store.next_token_logits(sid),
        store.ids(),
    )


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_every_bad_input_is_refused_clearly_and_changes_nothing(tiny_model):
    model = tiny_model.model
    store = SessionStore(model, CONFIG, capacity=2)
    sid = store.create()
    store.append(sid, list(range(1, 20)))  # past the budget
    vocab = store.verifier(sid).vocab_size
    before = _state(store, sid)
    for name, call, kind, fragment in _cases(store, sid, model, vocab):
        with pytest.raises(kind) as caught:
            call()
        assert fragment in str(caught.value), f"{name}: {caught.value}"
        assert _same(_state(store, sid), before), f"{name} changed the session"
    # the session still works, and the accepted kinds are accepted
    assert inputs.token_ids([np.int64(5), 6], vocab) == [5, 6]
    assert inputs.token_ids(np.array([5, 6], dtype=np.int32), vocab) == [5, 6]
    assert inputs.count(np.int64(3), "n") == 3
    store.append(sid, torch.tensor([5, 6]))
    store.append(sid, [np.int64(7)])
    tokens = [
        e.id for e in store.generate(sid, 3, stop_token_ids=[np.int64(9)]) if isinstance(e, Token)
    ]
    assert 1 <= len(tokens) <= 3
    assert SamplingConfig(temperature=1, top_k=np.int64(5)).top_k == 5


def test_verifier_commit_refuses_non_integers(tiny_model):
    """Needs ``Verifier.commit`` to validate ``n`` with ``inputs.count`` (engine-owned)."""
    v = Verifier(tiny_model.model, CONFIG)
    v.append([1, 2, 3])
    v.forward_block([4, 5])
    for bad, kind in [(True, TypeError), (1.5, TypeError), (3, ValueError), (-1, ValueError)]:
        with pytest.raises(kind):
            v.commit(bad)
        assert v.history_token_ids == [1, 2, 3] and v.pending_len == 2
    v.commit(1)
    assert v.history_token_ids == [1, 2, 3, 4]
