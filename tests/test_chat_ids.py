"""Chat deltas by token ids, generated replies included: the ids a session is given turn
by turn (user delta, the model's own reply ids, the template's end-of-turn tokens) equal
the tokenizer's chat template rendered over the whole conversation, token for token —
for replies cut by ``max_new_tokens`` and replies that stopped on EOS, on the default model
and on Qwen2.5-Coder's tokenizer."""

from __future__ import annotations

import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.data import chained_user_turns, chitchat_conversations
from kakeya_lab.models import load_model
from kakeya_lab.session import SessionStore, collect_reply, model_eos_ids

QWEN = "qwen2.5-coder-0.5b-instruct"


def _chat_by_ids(loaded, turns: int, max_new_tokens: int) -> set[str]:
    """Drive a real session; check the ids against the full render after every step;
    return the stop reasons seen."""
    tokenizer = loaded.tokenizer
    eos = model_eos_ids(loaded.model)
    chat = ChatTemplate(tokenizer)
    store = SessionStore(loaded.model, SinkWindowConfig(sink=4, window=4096), capacity=1)
    sid = store.create()
    held: list[int] = []
    stops = set()
    for i, text in enumerate(chained_user_turns(chitchat_conversations("dev"), turns)):
        delta = chat.user(text)
        store.append(sid, delta)
        held += delta
        assert held == chat.full_ids(add_generation_prompt=True), f"turn {i}: user delta"
        assert chat.end_of_turn_ids() == []
        result = collect_reply(store.generate(sid, max_new_tokens))
        held += result.token_ids
        stops.add(result.done.stop_reason)
        chat.generated(result.token_ids, eos_token_ids=eos)
        closing = chat.end_of_turn_ids()
        full = chat.full_ids(add_generation_prompt=False)
        assert held + closing == full, (
            f"turn {i} ({result.done.stop_reason}): first difference at "
            f"{next((k for k, (a, b) in enumerate(zip(held + closing, full)) if a != b), None)}"
        )
        if result.done.stop_reason == "eos":  # the EOS is the template's own end of turn
            assert result.token_ids[-1] in eos and closing[:1] != result.token_ids[-1:]
        else:
            assert closing[0] in eos  # the end-of-turn token the reply did not reach
    assert store.info(sid).history_len == len(held)  # the session holds exactly these ids
    return stops


@pytest.mark.slow  # the real default model, two conversations of real generation
def test_generated_replies_keep_ids_equal_to_the_full_render_default_model(default_model):
    stops = _chat_by_ids(default_model, turns=5, max_new_tokens=6)
    stops |= _chat_by_ids(default_model, turns=5, max_new_tokens=48)
    assert {"eos", "max_tokens"} <= stops  # both ways a reply ends were exercised


@pytest.mark.slow  # Qwen2.5-Coder 0.5B from the store, real generation
def test_generated_replies_keep_ids_equal_to_the_full_render_qwen():
    loaded = load_model(QWEN)
    stops = _chat_by_ids(loaded, turns=4, max_new_tokens=5)
    stops |= _chat_by_ids(loaded, turns=3, max_new_tokens=64)
    assert {"eos", "max_tokens"} <= stops


def test_a_reply_ending_on_a_token_the_template_does_not_close_with_is_refused(default_model):
    tokenizer = default_model.tokenizer
    chat = ChatTemplate(tokenizer)
    chat.user("Hello there.")
    state = chat.to_state()
    reply = tokenizer("Hi!", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    other_eos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    with pytest.raises(ValueError, match="does not close an assistant turn"):
        chat.generated(reply[:-1] + [other_eos], eos_token_ids={other_eos})
    assert chat.to_state() == state  # nothing recorded
    assert chat.generated(reply, eos_token_ids={tokenizer.eos_token_id}) == "Hi!"
    assert chat.end_of_turn_ids() == tokenizer("\n", add_special_tokens=False)["input_ids"]


def test_replay_renders_conversations_in_turn_and_cuts_at_the_limit(default_model):
    tok = default_model.tokenizer
    conversations = [
        ["Hi there.", "Hello!", "How are you?", "Fine."],
        ["Name a river.", "The Nile."],
    ]
    reference = ChatTemplate(tok)
    whole = [
        *reference.user("Hi there."),
        *reference.assistant("Hello!"),
        *reference.user("How are you?"),
        *reference.assistant("Fine."),
        *reference.user("Name a river."),  # each conversation starts with its user turn
        *reference.assistant("The Nile."),
    ]
    assert ChatTemplate(tok).replay(conversations, 10_000) == whole  # they ran out first
    assert ChatTemplate(tok).replay(conversations, 17) == whole[:17]
