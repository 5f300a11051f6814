"""The Spec-Bench-style table (:mod:`kakeya_lab.bench.spec_table`): one run per domain, arms
with their own draft lengths, per-arm losslessness and zero-accept rate, the wide view and
the targets check. Mechanics on the tiny random model (no quality number comes from it)."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.bench.spec_table import (
    TABLE_COLUMNS,
    cost_models,
    long_table,
    results_table,
    run_spec_table,
    table_records,
    targets_check,
    wide_table,
)
from kakeya_lab.bench.speculative import arm_draft_lengths, arm_lossless, run_speculative
from kakeya_lab.bench.speculative_settings import SpecTableSettings, SpeculativeSettings
from kakeya_lab.data import domain_conversations
from kakeya_lab.plots import spec_table_figure
from kakeya_lab.proposers import make_proposer

CACHE = SinkWindowConfig(sink=2, window=24)  # short: every domain's prompt crosses eviction


@pytest.fixture(scope="module")
def table(tiny_model):
    def make(spec):
        return lambda: make_proposer(spec, tiny_model.model, CACHE, tiny_model.tokenizer)

    settings = SpecTableSettings(
        arms=("ngram@2", "suffix-tree@3"),
        prompt_sets=("code-dev", "chitchat-dev"),
        sink=CACHE.sink,
        window=CACHE.window,
        conversations=1,
        turns=1,
        max_new_tokens=10,
        plain_kernels=(),  # plain decoding on the model's own kernel only (test_linear_auto.py
    )  # checks the fastest-kernel baseline)
    return run_spec_table(tiny_model, settings, make, progress=False)


def test_each_domain_runs_every_arm_at_its_own_length_beside_plain(table):
    assert list(table.runs) == ["code", "chitchat"]
    for run in table.runs.values():
        s = run.summary.set_index("arm")
        assert list(s.index) == ["plain", "ngram@2", "suffix-tree@3"]
        assert s.loc["ngram@2", "draft_length"] == 2 and s.loc["suffix-tree@3", "draft_length"] == 3
        assert sorted(run.cost.timings) == [1, 2, 3, 4]  # up to the longest arm + 1
        assert run.turns["history_len"].max() > CACHE.budget


def test_the_long_table_carries_every_metric_and_per_arm_losslessness(table):
    long = long_table(table)
    assert list(long.columns) == TABLE_COLUMNS
    assert len(long) == 2 * 3 and long["lossless"].all()
    assert set(long["plain_kernel"]) == {"aten"}  # the baseline's kernel, on every row
    spec = long[long["arm"] != "plain"]
    for r in spec.itertuples():
        run = table.runs[r.domain]
        steps = run.steps[(run.steps["arm"] == r.arm) & (run.steps["proposed"] > 0)]
        if len(steps):  # by hand: drafting steps that accepted nothing
            assert r.zero_accept_rate == pytest.approx((steps["accepted"] == 0).mean())
        assert r.step_cost_speedup > 0
    assert math.isnan(
        long.set_index(["domain", "arm"]).loc[("code", "suffix-tree@3"), "predicted_speedup"]
    )
    wide = wide_table(long)
    assert list(wide.columns) == ["code", "chitchat"]
    assert list(wide.index) == ["plain", "ngram@2", "suffix-tree@3"]
    assert (
        wide.loc["plain", "code"].endswith("tok/s (aten)")
        and "×" in wide.loc["ngram@2", "chitchat"]
    )
    assert list(cost_models(table)["domain"]) == ["code", "chitchat"]
    record = table_records(table)
    assert len(record["rows"]) == 6 and set(record["cost_models"]) == {"code", "chitchat"}
    assert spec_table_figure(long).data  # one bar trace per domain
    assert len(spec_table_figure(long).data) == 2


def test_targets_pick_the_fastest_lossless_arm_and_say_whether_it_is_met():
    long = pd.DataFrame(
        [
            {"domain": "code", "arm": "plain", "speedup": 1.0, "lossless": True},
            {"domain": "code", "arm": "a@2", "speedup": 2.7, "lossless": False},
            {"domain": "code", "arm": "b@2", "speedup": 2.1, "lossless": True},
            {"domain": "code", "arm": "hf-assisted", "speedup": 3.0, "lossless": True},
            # a slower kernel's plain decoding is a row of the table, never its best method
            {"domain": "code", "arm": "plain[onednn]", "speedup": 2.4, "lossless": True},
        ]
    )
    check = targets_check(long, {"code": 2.5, "prose": 2.5}).set_index("domain")
    assert list(check.index) == ["code"]  # no prose rows: nothing to check
    assert check.loc["code", "best_arm"] == "b@2" and not check.loc["code", "met"]


def test_arm_keys_with_a_draft_length_are_checked_before_any_work(tiny_model):
    assert arm_draft_lengths("ngram@8", [2, 4]) == [8]
    assert arm_draft_lengths("ngram", [2, 4]) == [2, 4]
    for bad in ("ngram@", "ngram@0", "@3", "ngram@x"):
        with pytest.raises(ValueError, match="draft length like ngram@8"):
            arm_draft_lengths(bad, [])
    convs = domain_conversations("chitchat", "dev", limit=1)
    with pytest.raises(ValueError, match="draft length"):
        run_speculative(
            tiny_model,
            {"ngram@0": lambda: None},
            convs,
            SpeculativeSettings.for_cache(CACHE, draft_lengths=()),
        )
    with pytest.raises(ValueError, match="draft lengths must be"):
        run_speculative(
            tiny_model,
            {"ngram": lambda: None},
            convs,
            SpeculativeSettings.for_cache(CACHE, draft_lengths=()),
        )
    with pytest.raises(ValueError, match="needs its draft length"):
        SpecTableSettings(arms=("ngram",), prompt_sets=("code-dev",))


def test_arm_lossless_names_the_arm_that_strayed():
    turns = pd.DataFrame(
        [
            {"arm": "plain", "conversation": "c", "turn": 0, "reply_ids": [1, 2]},
            {"arm": "x@2", "conversation": "c", "turn": 0, "reply_ids": [1, 2]},
            {"arm": "y@2", "conversation": "c", "turn": 0, "reply_ids": [1, 3]},
        ]
    )
    assert arm_lossless(turns) == {"plain": True, "x@2": True, "y@2": False}


def test_the_results_table_quotes_each_cell_with_a_claim_on_its_csv_row(table, tmp_path):
    long = long_table(table)
    text, claims = results_table(long)
    assert text.splitlines()[0] == "| arm | code | chitchat |"
    assert len(text.splitlines()) == 2 + 3  # header, rule, plain and two arms
    long.to_csv(tmp_path / "table.csv", index=False)
    rows = pd.read_csv(tmp_path / "table.csv")
    for claim in claims:
        assert claim["quote"] in text
        i, column = claim["key"].split(".")
        number = re.findall(r"\d+\.\d+", claim["quote"])[claim.get("index", 0)]
        decimals = len(number.split(".")[1])
        assert float(number) == round(float(rows.loc[int(i), column]), decimals)


def test_the_wide_table_puts_plain_decoding_first_and_names_the_baseline_kernel():
    row = {"tau": None, "lossless": True}
    long = pd.DataFrame(
        [
            {**row, "domain": "code", "arm": "plain", "tokens_per_s": 20.0, "speedup": 1.0, "plain_kernel": "aten"},
            {**row, "domain": "code", "arm": "ngram@4", "tokens_per_s": 30.0, "speedup": 1.5, "plain_kernel": "aten", "tau": 1.6},
            {**row, "domain": "code", "arm": "plain[onednn]", "tokens_per_s": 18.0, "speedup": 0.9, "plain_kernel": "aten"},
        ]
    )  # fmt: skip
    wide = wide_table(long)
    assert list(wide.index) == ["plain", "plain[onednn]", "ngram@4"]
    assert wide.loc["plain", "code"] == "20.0 tok/s (aten)"
    assert wide.loc["plain[onednn]", "code"] == "18.0 tok/s"
    assert wide.loc["ngram@4", "code"] == "1.50× (τ 1.60)"
