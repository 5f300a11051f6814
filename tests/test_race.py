"""The race view without a browser: both lanes decode the same message on sessions with
the same history, greedy outputs identical past eviction, Stop ends both, bad input is
refused (tiny random model: mechanics only; speedups are benchmarks, not tests)."""

from __future__ import annotations

import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.widgets.race import Race, RaceView

CONFIG = SinkWindowConfig(sink=2, window=14)  # small: the conversation evicts


def test_both_lanes_give_the_same_greedy_tokens_and_keep_the_same_history(tiny_model):
    race = Race(tiny_model, CONFIG, proposer="ngram", draft_length=3, max_new_tokens=20)
    for message in ("one two three one two three", "again: one two three one two"):
        turn = race.send(message)
        race.wait(60)
        assert turn.error is None and turn.finished
        assert turn.plain.token_ids == turn.speculative.token_ids and turn.plain.token_ids
        assert turn.plain.seconds > 0 and turn.speculative.seconds > 0
        assert turn.speculative.proposed >= turn.speculative.accepted >= 0
        assert turn.plain.proposed == 0 and turn.speedup is not None
    plain, speculative = race.histories()
    assert plain == speculative and len(plain) > CONFIG.sink + CONFIG.window  # evicted


def test_stop_ends_both_lanes_and_each_session_holds_what_it_showed(tiny_model):
    race = Race(tiny_model, CONFIG, proposer="ngram", max_new_tokens=2000)
    seen = []

    def stop_after_some(turn):
        seen.append(1)
        if len(seen) == 10:
            race.stop()

    turn = race.send("go on and on", on_update=stop_after_some)
    race.wait(120)
    assert turn.plain.stop_reason == turn.speculative.stop_reason == "stopped"
    plain, speculative = race.histories()
    assert plain[len(plain) - len(turn.plain.token_ids) :] == turn.plain.token_ids
    tail = speculative[len(speculative) - len(turn.speculative.token_ids) :]
    assert tail == turn.speculative.token_ids
    assert len(turn.plain.token_ids) + len(turn.speculative.token_ids) < 2 * 2000


def test_bad_input_is_refused_before_anything_runs(tiny_model):
    with pytest.raises(ValueError, match="needs a proposer"):
        Race(tiny_model, CONFIG, proposer="none")
    with pytest.raises(ValueError, match="draft_length"):
        Race(tiny_model, CONFIG, proposer="ngram", draft_length=0)
    with pytest.raises(ValueError):
        Race(tiny_model, CONFIG, proposer="ngram:0")
    race = Race(tiny_model, CONFIG, proposer="ngram")
    with pytest.raises(ValueError, match="empty message"):
        race.send("  ")
    assert race.turns == [] and race.histories() == ([], [])


def test_the_view_streams_both_lanes(tiny_model):
    view = RaceView(tiny_model, CONFIG, proposer="ngram", max_new_tokens=8)
    view.message.value = "one two one two"
    view.message.submit()  # what Enter does in the page
    turn = view.wait(60)
    assert turn is not None and turn.finished
    assert f'data-tokens="{len(turn.plain.token_ids)}"' in view.lanes[0].value
    assert f'data-tokens="{len(turn.speculative.token_ids)}"' in view.lanes[1].value
    assert 'data-state="done"' in view.status.value and "same tokens" in view.status.value
    assert not view.go_button.disabled and view.stop_button.disabled
