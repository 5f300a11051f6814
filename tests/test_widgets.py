"""The notebook views without a browser: the live chat's stop contract, the panel's bounded
transcript, the cache explorer's frames and the notebook byte form (tiny random model)."""

from __future__ import annotations

import json
import time

import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.notebook_format import KERNEL_NAME, jupyterlab_text
from kakeya_lab.verifier import Verifier
from kakeya_lab.widgets import (
    ChatPanel,
    LiveChat,
    cache_explorer_figure,
    cache_status,
    record_cache_steps,
)

CONFIG = SinkWindowConfig(sink=2, window=14)  # small: a few turns evict


def test_a_stopped_reply_leaves_the_session_holding_exactly_the_tokens_delivered(tiny_model):
    chat = LiveChat(tiny_model, CONFIG, max_new_tokens=400)
    seen = []
    record = chat.send("Tell me a long story.", on_token=lambda r: seen.append(len(r.token_ids)))
    deadline = time.monotonic() + 30
    while len(record.token_ids) < 5 and not record.finished:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    chat.stop()
    chat.wait(30)
    assert record.finished and record.stop_reason == "stopped" and record.error is None
    assert 5 <= len(record.token_ids) < 400
    assert chat.session_reply_ids() == record.token_ids and record.undelivered_tokens == 0
    assert seen == list(range(1, len(record.token_ids) + 1))  # streamed one token at a time
    assert record.text == tiny_model.tokenizer.decode(record.token_ids, skip_special_tokens=True)
    # the conversation goes on from exactly there
    nxt = chat.send("And then?")
    chat.wait(30)
    assert nxt.error is None and chat.session_reply_ids() == nxt.token_ids
    snap = chat.cache_snapshot()
    assert snap.sink_tokens + snap.window_tokens <= CONFIG.sink + CONFIG.window
    assert snap.evicted_tokens == snap.history_tokens - snap.sink_tokens - snap.window_tokens > 0
    assert snap.kv_live_bytes == snap.kv_budget_bytes


def test_bad_input_is_a_clear_error_and_changes_nothing(tiny_model):
    chat = LiveChat(tiny_model, CONFIG, max_new_tokens=4)
    with pytest.raises(ValueError, match="empty message"):
        chat.send("   ")
    with pytest.raises(ValueError, match="draft_length"):
        chat.send("hi", proposer="ngram", draft_length=0)
    with pytest.raises(ValueError, match="tokenizer"):
        LiveChat(chat.store)
    assert chat.replies == [] and chat.cache_snapshot().history_tokens == 0


def test_speculative_tokens_are_tagged_and_the_stream_is_the_plain_one(tiny_model):
    plain, spec = (
        LiveChat(tiny_model, CONFIG, max_new_tokens=24),
        LiveChat(tiny_model, CONFIG, max_new_tokens=24),
    )
    for message in ("one two three one two three", "again: one two three"):
        a = plain.send(message)
        plain.wait(30)
        b = spec.send(message, proposer="ngram", draft_length=3)
        spec.wait(30)
        assert a.token_ids == b.token_ids and b.error is None
        assert set(b.token_kinds) <= {"draft", "verifier"} and len(b.token_kinds) == len(
            b.token_ids
        )
        assert set(a.token_kinds) == {"verifier"}


def test_the_panel_offers_the_registry_draft_model_and_it_decodes_losslessly(
    default_model, tiny_model
):
    """The default model's registry draft (its own weights in int4) is offered by name in the
    panel; two turns through a cache the conversation outgrows equal plain decoding."""
    from kakeya_lab.linear import linear_kernel_of

    config = SinkWindowConfig(sink=4, window=28)
    spec = "draft:smollm2-135m-instruct:int4"
    panel, plain = (ChatPanel(default_model, config, max_new_tokens=12) for _ in range(2))
    assert spec in panel.proposer.options and "suffix" in panel.proposer.options
    assert spec not in ChatPanel(tiny_model, CONFIG).proposer.options  # not a registry model
    panel.proposer.value = spec
    for message in ("Hi! How are you today?", "Tell me about your favourite book."):
        a = plain.send(message)
        plain.wait(120)
        b = panel.send(message)
        panel.wait(120)
        assert a is not None and b is not None
        assert b.error is None and b.proposer == spec and a.token_ids == b.token_ids
    assert "draft" in b.token_kinds
    assert linear_kernel_of(panel.chat.proposer(spec).model) == "int4"
    assert panel.chat.cache_snapshot().evicted_tokens > 0


def test_the_panel_keeps_only_the_last_turns_on_the_page(tiny_model):
    panel = ChatPanel(tiny_model, CONFIG, max_new_tokens=3, keep_turns=2)
    for i in range(5):
        panel.send(f"message {i}")
        panel.wait(30)
    assert len(panel.chat.replies) == 5
    assert len(panel.transcript.children) == 4  # two turns: user + reply each
    assert "message 4" in panel.transcript.children[-2].value
    assert 'data-stop-reason="max_tokens"' in panel.status.value
    static = panel.transcript_html(last=1)
    assert "message 4" in static and "message 3" not in static
    assert "make lab" in panel._repr_mimebundle_()["text/plain"]  # what a static view says


def test_cache_explorer_has_one_frame_per_step_coloured_by_the_sink_window_rule(tiny_model):
    cfg = SinkWindowConfig(sink=2, window=6)
    ids = list(range(100, 124))
    steps = record_cache_steps(Verifier(tiny_model.model, cfg), ids, chunk=4)
    fig = cache_explorer_figure(tiny_model.tokenizer, ids, steps, sink=cfg.sink)
    assert len(fig.frames) == len(steps) == 6
    assert fig.layout.sliders[0].active == 5
    last = cache_status(steps[-1], 24, cfg.sink, 24)
    assert last.count("sink") == 2 and last.count("window") == 6 and last.count("evicted") == 16
    first = cache_status(steps[0], 4, cfg.sink, 24)
    assert first.count("unseen") == 20 and first.count("evicted") == 0
    assert "step 0" in fig.frames[0].layout.title.text and "step 5" in fig.layout.title.text
    with pytest.raises(ValueError, match="no steps"):
        cache_explorer_figure(tiny_model.tokenizer, ids, [], sink=2)


def test_notebook_form_is_what_jupyterlab_writes():
    nb = {
        "cells": [],
        "metadata": {"widgets": {"x": 1}, "kernelspec": {"name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    nb["cells"].append(
        {
            "cell_type": "code",
            "execution_count": 1,
            "id": "a1",
            "metadata": {},
            "source": "x = 1",
            "outputs": [
                {
                    "output_type": "execute_result",
                    "execution_count": 1,
                    "metadata": {},
                    "data": {"application/json": {"y": [1.0, 0.5, -0.0, 1e22, 3.0e-7]}},
                }
            ],
        }
    )
    text = jupyterlab_text(nb)
    saved = json.loads(text)
    assert text.endswith("}\n") and text.startswith('{\n "cells"')  # indent 1, sorted keys
    assert (
        saved["metadata"]["kernelspec"]["name"] == KERNEL_NAME
        and "widgets" not in saved["metadata"]
    )
    assert saved["cells"][0]["outputs"][0]["data"]["application/json"]["y"] == [
        1,
        0.5,
        0,
        1e22,
        3e-7,
    ]
    assert '"y": [\n' in text and " 1,\n" in text and "1e+22" in text
    assert jupyterlab_text(saved) == text  # a fixed point: saving again changes nothing
