"""The notebook views without a browser: the live chat's stop contract, the panel's bounded
transcript, the cache explorer's frames and the notebook byte form (tiny random model)."""

from __future__ import annotations

import base64
import json
import re
import time

import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.notebook_format import KERNEL_NAME, jupyterlab_text
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.verifier import Verifier
from kakeya_lab.widgets import (
    ChatPanel,
    LiveChat,
    cache_explorer_figure,
    cache_status,
    record_cache_steps,
)
from kakeya_lab.widgets.chat_panel import status_html
from kakeya_lab.widgets.live_chat import latency_drift, plural, token_latency_percentiles

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


@pytest.mark.slow
def test_the_panel_offers_the_registry_draft_model_and_it_decodes_losslessly(
    default_model, tiny_model
):
    """The default model's registry draft (its own weights in int4) is offered by name in the
    panel; two turns through a cache the conversation outgrows equal plain decoding."""
    from kakeya_lab.linear import linear_kernel_of
    from kakeya_lab.native.int4 import why_unavailable as int4_unavailable

    config = SinkWindowConfig(sink=4, window=28)
    spec = "draft:smollm2-135m-instruct:int4"
    panel, plain = (ChatPanel(default_model, config, max_new_tokens=12) for _ in range(2))
    assert spec in panel.proposer.options and "suffix" in panel.proposer.options
    if not int4_unavailable():  # the same weights on the faster kernel, offered beside them
        assert f"{spec}-vnni" in panel.proposer.options
    assert spec not in ChatPanel(tiny_model, CONFIG).proposer.options  # not a registry model
    panel.proposer.value = spec
    # the draft model loads on the loader thread: "loading" at once, and Stop cancels the
    # turn before anything reaches the session (the load is kept for the next turn)
    seen: list[str | None] = []
    record = panel.chat.send("Hi!", proposer=spec, on_loading=lambda r: seen.append(r.loading))
    panel.stop()
    panel.wait(120)
    assert seen == [spec] and record.stop_reason == "stopped" and record.history_start is None
    assert panel.chat.cache_snapshot().history_tokens == 0  # nothing was sent
    assert "stopped while loading" in status_html(record, busy=False)
    panel.reset()
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
    assert len(panel.transcript.children) == 4  # two turns: user + reply each, newest first
    assert "message 4" in panel.transcript.children[1].value
    assert "message 3" in panel.transcript.children[3].value
    assert 'data-turn="5"' in panel.transcript.children[0].value  # user turns count from 1
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
    # the legend is outside the grid (right of the plot area, in a margin made for it)
    assert fig.layout.legend.x >= 1 and fig.layout.legend.xanchor == "left"
    assert fig.layout.margin.r >= 100
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


def test_turns_count_from_one_and_the_readouts_are_defined(tiny_model):
    panel = ChatPanel(tiny_model, CONFIG, max_new_tokens=6)
    for message in ("one", "two", "three", "four"):
        panel.send(message)
        panel.wait(30)
    assert [r.turn for r in panel.chat.replies] == [1, 2, 3, 4]
    readout = panel.latency_view.value
    p50, p95 = token_latency_percentiles(panel.chat.replies[-1])
    assert p50 is not None and p95 is not None and 0 < p50 <= p95
    assert f"turn 4: p50 {1e3 * p50:.1f} ms, p95 {1e3 * p95:.1f} ms" in readout
    # the drift is a slope with its interval over the finished turns, not a two-point ratio
    drift = latency_drift(panel.chat.latency_by_turn())
    assert (
        drift is not None and drift.turns == 4 and drift.low_ms <= drift.slope_ms <= drift.high_ms
    )
    assert f"{drift.slope_ms:+.2f} ms/token per turn" in readout
    assert latency_drift([0.01, 0.02]) is None  # two turns give no interval
    assert plural(1, "token") == "1 token" and plural(2, "token") == "2 tokens"


def test_an_empty_message_gets_a_hint_and_enter_sends(tiny_model):
    panel = ChatPanel(tiny_model, CONFIG, max_new_tokens=3)
    panel.message.value = "   "
    panel.message.submit()  # what Enter does in the page
    assert 'data-state="hint"' in panel.status.value and panel.chat.replies == []
    panel.message.value = "hello there"
    panel.message.submit()
    record = panel.wait(30)
    assert record is not None and record.user_text == "hello there" and record.turn == 1
    assert panel.message.value == ""


def test_controls_are_disabled_while_a_reply_streams(tiny_model):
    panel = ChatPanel(tiny_model, CONFIG, max_new_tokens=400)
    assert panel.draft_length.disabled  # no proposer: no draft length
    assert panel.top_p.disabled and panel.seed.disabled  # greedy: no top-p, no seed
    record = panel.send("tell me everything")
    assert record is not None
    busy = [
        panel.message,
        panel.send_button,
        panel.proposer,
        panel.draft_length,
        panel.temperature,
        panel.reset_button,
        panel.export_button,
    ]
    assert all(c.disabled for c in busy) and not panel.stop_button.disabled
    assert panel.send("another") is None and len(panel.chat.replies) == 1  # refused, said so
    assert "Stop it first" in panel.status.value
    panel.stop()
    panel.wait(30)
    assert not any(c.disabled for c in busy if c is not panel.draft_length)
    assert panel.stop_button.disabled
    panel.proposer.value = "ngram"
    assert not panel.draft_length.disabled
    panel.temperature.value = 0.7
    assert not panel.top_p.disabled and not panel.seed.disabled


def test_sampling_controls_reach_the_session(tiny_model):
    panel = ChatPanel(tiny_model, CONFIG, max_new_tokens=8)
    assert panel.sampling() == SamplingConfig()
    panel.temperature.value, panel.top_p.value, panel.seed.value = 1.0, 0.9, 7
    assert panel.sampling() == SamplingConfig(temperature=1.0, top_p=0.9, seed=7)
    first = panel.send("pick a word")
    panel.wait(30)
    again = ChatPanel(tiny_model, CONFIG, max_new_tokens=8)
    again.temperature.value, again.top_p.value, again.seed.value = 1.0, 0.9, 7
    second = again.send("pick a word")
    again.wait(30)
    greedy = ChatPanel(tiny_model, CONFIG, max_new_tokens=8)
    plain = greedy.send("pick a word")
    greedy.wait(30)
    assert first is not None and second is not None and plain is not None
    assert first.sampling.temperature == 1.0 and first.token_ids == second.token_ids  # seeded
    assert first.token_ids != plain.token_ids  # and not greedy
    panel.temperature.value = 1e-5  # below what the sampler accepts: a hint, nothing sent
    assert panel.send("hi") is None and "temperature" in panel.status.value
    assert len(panel.chat.replies) == 1


def test_new_conversation_empties_the_page_and_the_session(tiny_model):
    panel = ChatPanel(tiny_model, CONFIG, max_new_tokens=4)
    panel.send("first")
    panel.wait(30)
    old = panel.chat.session_id
    panel.reset()
    assert panel.chat.replies == [] and panel.transcript.children == ()
    assert panel.chat.session_id != old and old not in panel.chat.store.ids()
    assert panel.chat.cache_snapshot().history_tokens == 0
    record = panel.send("first")
    panel.wait(30)
    fresh = LiveChat(tiny_model, CONFIG, max_new_tokens=4)
    clean = fresh.send("first")
    fresh.wait(30)
    assert record is not None and record.turn == 1 and record.token_ids == clean.token_ids


def test_the_export_holds_the_session_history(tiny_model):
    panel = ChatPanel(tiny_model, CONFIG, max_new_tokens=5)
    for message, proposer in (("one two one two", "none"), ("one two one two", "ngram")):
        panel.proposer.value = proposer
        panel.send(message)
        panel.wait(30)
    data = panel.chat.transcript()
    history = panel.chat.store.verifier(panel.chat.session_id).history_token_ids
    assert data["history_token_ids"] == list(history)
    assert data["cache"]["sink"] == CONFIG.sink and data["backend"] == "torch"
    for turn, record in zip(data["turns"], panel.chat.replies):
        assert turn["token_ids"] == panel.chat.session_reply_ids(record.turn - 1)
        assert len(turn["token_kinds"]) == len(turn["token_latency_s"]) == len(turn["token_ids"])
    assert data["turns"][1]["proposer"] == "ngram"
    panel.show_export()
    links = panel.export_view.value
    match = re.search(
        r'class="kl-export-json"[^>]*href="data:application/json;base64,([^"]+)"', links
    )
    assert match is not None
    assert json.loads(base64.b64decode(match.group(1)))["history_token_ids"] == list(history)
    markdown = panel.chat.transcript_markdown()
    assert "## Turn 1" in markdown and "## Turn 2" in markdown and "**you:** one two" in markdown
