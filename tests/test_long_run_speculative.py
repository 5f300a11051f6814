"""The speculative arm of the long run: greedy, so every turn's reply equals the plain
sink-window arm's, across eviction; and the long-run CLI refuses bad pacing and proposer
arguments before anything loads."""

from __future__ import annotations

import pandas as pd
import pytest

from kakeya_lab.bench.long_run import LongRunSettings, run_long, standard_arms
from kakeya_lab.bench.long_run.records import ids_digest
from kakeya_lab.bench.long_run.summary import relative_drift, replies_match
from kakeya_lab.data import chained_user_turns, chitchat_conversations


@pytest.mark.slow  # the real default model over six turns, two arms
def test_speculative_arm_replies_equal_plain_greedy_past_eviction(aten_model):
    settings = LongRunSettings(
        arms=("sink_window", "speculative"),
        sink=4,
        window=40,
        proposer="ngram",
        draft_length=4,
        turns=6,
        max_new_tokens=16,
        probe_every=0,
        turns_per_bucket=2,
    )
    turns = chained_user_turns(chitchat_conversations("dev"), 6)
    run = run_long(aten_model, settings, turns, progress=False)
    plain = run.turns[run.turns["arm"] == "sink_window"].set_index("turn")
    spec = run.turns[run.turns["arm"] == "speculative"].set_index("turn")
    assert list(spec.index) == list(plain.index) == list(range(6))
    assert (spec["error"].isna()).all() and (plain["error"].isna()).all()
    for turn in plain.index:
        assert spec.loc[turn, "reply"] == plain.loc[turn, "reply"], turn
        assert spec.loc[turn, "history_len"] == plain.loc[turn, "history_len"]
    assert (
        spec["history_len"].iloc[-1] > spec["cache_len"].iloc[-1] == 44
    )  # evicted for several turns
    assert spec["accepted"].sum() > 0 and plain["proposed"].sum() == 0  # drafts were really used
    assert run.summary["speculative"]["kv_bounded"] is True
    # the summary records the per-turn equality of the reply token ids
    assert run.summary["speculative"]["matches_plain"] == {
        "plain_arm": "sink_window",
        "turns_compared": 6,
        "turns_equal": 6,
        "first_mismatch_turn": None,
    }
    assert "matches_plain" not in run.summary["sink_window"]
    assert spec["reply_ids_sha256"].tolist() == plain["reply_ids_sha256"].tolist()
    assert plain["reply_ids_sha256"].nunique() == 6  # a digest per reply, not a constant
    step = run.summary["speculative"]["step_over_plain"]
    assert step["turns_compared"] == 6 and step["column"] == "step_s"
    assert step["median_ratio"] > 1.0  # a block of 5 costs more than one token


def test_replies_match_names_the_first_turn_that_differs():
    rows = [
        {"arm": arm, "turn": t, "error": None, "reply_ids_sha256": ids_digest([t, 7])}
        for arm in ("sink_window", "speculative")
        for t in range(4)
    ]
    rows[4 + 2]["reply_ids_sha256"] = ids_digest([2, 8])  # speculative, turn 2
    rows[4 + 3]["reply_ids_sha256"] = ids_digest([3])  # speculative, turn 3
    rows.append({"arm": "sink_window", "turn": 4, "error": None, "reply_ids_sha256": "x"})
    table = pd.DataFrame(rows)
    assert replies_match(table, "speculative", "sink_window") == {
        "plain_arm": "sink_window",
        "turns_compared": 4,
        "turns_equal": 2,
        "first_mismatch_turn": 2,
    }
    table.loc[7, "error"] = "turn 3: boom"  # a failed turn is not compared
    assert replies_match(table, "speculative", "sink_window")["turns_compared"] == 3
    assert ids_digest([1, 2]) != ids_digest([2, 1]) and ids_digest([1, 2]) == ids_digest((1, 2))


def test_relative_drift_cancels_the_machine_and_keeps_the_arm():
    load = [1.0, 3.0, 1.5, 0.7, 2.0, 1.0]  # the machine's slowdown per round, both arms alike
    rows = []
    for turn, factor in enumerate(load):
        rows.append(
            {
                "arm": "sink_window",
                "turn": turn,
                "error": None,
                "decode_s_per_token": 0.1 * factor,
                "generate_s": 1.6 * factor,
                "generated_tokens": 16,
                "tau": None,
            }
        )
        grow = 1.0 + 0.1 * turn  # the speculative arm's own cost grows with the history
        rows.append(
            {
                "arm": "speculative",
                "turn": turn,
                "error": None,
                "decode_s_per_token": 0.05 * factor * grow,
                "generate_s": 0.8 * factor * grow,
                "generated_tokens": 16,
                "tau": 4.0,
            }
        )
    table = pd.DataFrame(rows)
    per_token = relative_drift(table, "speculative", "sink_window", turns_per_bucket=2)
    # buckets {0,1} and {4,5}: ratio p50 0.5 * 1.05 -> 0.5 * 1.45
    assert per_token["drift_pct"] == pytest.approx(100 * (1.45 - 1.05) / 1.05)
    step = relative_drift(table, "speculative", "sink_window", "step_s", turns_per_bucket=2)
    assert step["first_p50"] == pytest.approx(2.0 * 1.05)  # 4 tokens per forward at half cost
    flat = table.assign(
        decode_s_per_token=[
            0.1 * f if i % 2 == 0 else 0.05 * f
            for i, f in enumerate(x for x in load for _ in range(2))
        ]
    )
    assert relative_drift(flat, "speculative", "sink_window", turns_per_bucket=2)[
        "drift_pct"
    ] == pytest.approx(0.0)


def test_speculative_arm_settings_are_checked_without_a_model():
    with pytest.raises(ValueError, match="needs a proposer"):
        standard_arms(4, 40, names=("speculative",))
    with pytest.raises(ValueError, match="no speculative arm"):
        standard_arms(4, 40, names=("sink_window",), proposer="ngram")
    with pytest.raises(ValueError, match="n-gram sizes"):
        standard_arms(4, 40, names=("speculative",), proposer="ngram:3,x")
    with pytest.raises(ValueError, match="draft_length"):
        standard_arms(4, 40, names=("speculative",), proposer="ngram", draft_length=0)
    arm = standard_arms(4, 40, names=("speculative",), proposer="ngram:2,1", draft_length=3)[
        "speculative"
    ]
    assert arm.to_dict()["proposer"] == "ngram:2,1" and arm.config.budget == 44
    assert "proposer" not in standard_arms(4, 40, names=("sink_window",))["sink_window"].to_dict()


@pytest.mark.parametrize(
    "extra,said",
    [
        (["--arms", "speculative"], "needs --proposer"),
        (["--proposer", "ngram"], "add it, e.g. --arms sink_window,speculative"),
        (["--arms", "speculative", "--proposer", "oracle"], "unknown proposer 'oracle'"),
        (
            ["--arms", "speculative", "--proposer", "ngram", "--draft-length", "0"],
            "--draft-length must be >= 1",
        ),
        (["--turn-spacing-s", "0"], "--turn-spacing-s must be a finite number > 0"),
        (["--report-every-s", "-5"], "--report-every-s must be a finite number >= 0"),
        (["--seconds-per-bucket", "nan"], "--seconds-per-bucket"),
    ],
)
def test_long_run_cli_refuses_bad_arguments_before_loading(extra, said, tmp_path, capsys):
    from kakeya_lab.cli import main

    assert main(["long-run", str(tmp_path / "out"), "--turns", "3", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "out").exists()
