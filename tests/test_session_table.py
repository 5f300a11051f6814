"""The store's one session table shared by several callers: metadata, claims, LRU eviction
by predicate; and the one chat-turn loop keeping the chat template in step with the session."""

from __future__ import annotations

import pytest

from kakeya_lab import SinkWindowConfig
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.session import (
    SessionInUse,
    SessionStore,
    Token,
    UnknownSession,
    append_message,
    chat_turn,
    collect_reply,
)

CONFIG = SinkWindowConfig(sink=2, window=12)


def test_metadata_claims_and_lru_eviction_by_predicate(tiny_model):
    store = SessionStore(tiny_model.model, CONFIG, capacity=4)
    a = store.create(metadata="implicit")
    b = store.create(metadata="implicit", claimed=True)
    c = store.create(metadata="explicit")
    assert [store.metadata(s) for s in (a, b, c)] == ["implicit", "implicit", "explicit"]
    with pytest.raises(SessionInUse):
        store.claim(b)  # opened claimed
    assert store.claim_where(lambda m: m == "implicit") == [a]  # b is claimed already
    store.release(a)
    store.append(a, [1, 2, 3])  # a is now the most recently used
    # the least recently used unclaimed "implicit" session is a; b is claimed, c does not match
    assert store.evict_lru(lambda m: m == "implicit", "room for a request") == a
    with pytest.raises(UnknownSession, match="room for a request"):
        store.metadata(a)
    assert store.evict_lru(lambda m: m == "implicit", "again") is None
    store.release(b)
    assert store.evict_lru(lambda m: m == "implicit", "again") == b
    assert store.ids() == [c]
    store.release(a)  # releasing a closed session is a no-op


def test_chat_turn_records_exactly_the_delivered_reply(default_model):
    tok = default_model.tokenizer
    store = SessionStore(default_model.model, SinkWindowConfig(sink=4, window=None), capacity=1)
    sid = store.create()
    chat = ChatTemplate(tok)
    turn = chat_turn(store, sid, chat, "Name a colour.", 8)
    reply = collect_reply(turn)
    assert turn.token_ids == reply.token_ids and turn.done is reply.done
    history = store.verifier(sid).history_token_ids
    assert history == turn.prompt_ids + reply.token_ids
    assert not chat.awaiting_reply and turn.text is not None
    # cut short after one token: the template records exactly what the session holds
    turn = chat_turn(store, sid, chat, "And another?", 8)
    next(e for e in turn if isinstance(e, Token))
    turn.close()
    held = store.verifier(sid).history_token_ids
    assert len(turn.token_ids) == 1 and held[-1] == turn.token_ids[0]
    assert not chat.awaiting_reply
    assert tok.decode(held, skip_special_tokens=False) == chat.rendered


def test_append_message_restores_the_template_on_failure(default_model):
    store = SessionStore(default_model.model, CONFIG, capacity=1)
    sid = store.create()
    chat = ChatTemplate(default_model.tokenizer)

    def refuse(ids: list[int]) -> list[int]:
        raise ValueError("too long")

    with pytest.raises(ValueError, match="too long"):
        append_message(store, sid, chat, "user", "hello", check_ids=refuse)
    assert chat.messages == [] and chat.rendered == "" and not chat.awaiting_reply
    ids, result = append_message(store, sid, chat, "user", "hello")
    assert result.appended == len(ids) and chat.awaiting_reply
