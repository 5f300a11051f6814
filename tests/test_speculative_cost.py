"""The cost model every speculative benchmark run carries (``run.cost``): the verifier block
cost measured on the real default model, each arm's drafting cost and predicted speedups,
checked against the formulas computed by hand."""

from __future__ import annotations

import json
import statistics

import pandas as pd
import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_cost import ARM_COLUMNS, arm_costs
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.cost_model import BlockCost
from kakeya_lab.data import domain_conversations
from kakeya_lab.plots import cost_model_figure
from kakeya_lab.proposers import NgramProposer
from kakeya_lab.proposers.trees import SuffixTreeProposer


def test_arm_costs_follow_the_formulas_by_hand():
    block = BlockCost(fixed_s=0.1, per_token_s=0.01)  # v(1) = 0.11, v(3) = 0.13
    summary = pd.DataFrame(
        [
            {"arm": "plain", "draft_length": 0, "acceptance_probability": None, "speedup": 1.0},
            {"arm": "x@2", "draft_length": 2, "acceptance_probability": 0.5, "speedup": 1.2},
        ]
    )
    steps = pd.DataFrame(
        {
            "arm": ["x@2", "x@2"],
            "proposed": [2, 2],
            "emitted": [3, 1],
            "proposer_s": [0.01, 0.01],
        }
    )
    row = arm_costs(block, summary, steps).set_index("arm").loc["x@2"]
    assert row["draft_token_s"] == pytest.approx(0.02 / 4)
    assert row["draft_cost_ratio"] == pytest.approx(0.005 / 0.11)
    # E[tokens] = 1 + 0.5 + 0.25 in v(3) + 2 d = 0.13 + 0.01 s, against 1 token per 0.11 s
    assert row["predicted_speedup"] == pytest.approx(1.75 / 0.14 * 0.11)
    # 4 tokens would take 4 v(1) plainly; the steps took 2 v(3) + 0.02 s
    assert row["step_cost_speedup"] == pytest.approx(4 * 0.11 / (2 * 0.13 + 0.02))
    assert row["speedup"] == 1.2
    no_drafts = steps.assign(proposed=[0, 0], emitted=[1, 1], proposer_s=[0.0, 0.0])
    row = arm_costs(block, summary, no_drafts).set_index("arm").loc["x@2"]
    assert row["draft_token_s"] is None and row["predicted_speedup"] is None
    assert row["step_cost_speedup"] == pytest.approx(1.0)  # plain steps cost plain time


@pytest.mark.slow  # two short benchmark runs of the real model (10-20 s on the shared machine)
def test_a_run_carries_its_fitted_cost_model(default_model):
    cache = SinkWindowConfig(sink=4, window=60)
    run = run_speculative(
        default_model,
        {"ngram": NgramProposer},
        domain_conversations("chitchat", "dev", limit=1),
        SpeculativeSettings.for_cache(
            cache, draft_lengths=(2, 3), turns=1, max_new_tokens=12, cost_repeats=3
        ),
        progress=False,
    )
    cost = run.cost
    assert cost is not None and cost.context_tokens > 0
    assert sorted(cost.timings) == [1, 2, 3, 4]  # 1 .. longest draft + 1
    assert all(len(ts) == 2 * 3 and min(ts) > 0 for ts in cost.timings.values())  # before + after
    # the block cost of a measured size is the median of its timings
    assert all(cost.block(n) == statistics.median(ts) for n, ts in cost.timings.items())
    assert list(cost.arms.columns) == ARM_COLUMNS
    assert list(cost.arms["arm"]) == ["ngram@2", "ngram@3"]
    summary = run.summary.set_index("arm")
    v1 = cost.block(1)
    for r in cost.arms.itertuples():
        s = run.steps[run.steps["arm"] == r.arm]
        assert r.speedup == summary.loc[r.arm, "speedup"]
        spent = sum(cost.block(int(p) + 1) for p in s["proposed"]) + s["proposer_s"].sum()
        assert r.step_cost_speedup == pytest.approx(s["emitted"].sum() * v1 / spent)
        if r.draft_token_s is not None:
            a, k, d = r.acceptance_probability, r.draft_length, r.draft_token_s
            assert r.draft_cost_ratio == pytest.approx(d / v1) and r.draft_cost_ratio > 0
            tokens = sum(a**i for i in range(k + 1))
            assert r.predicted_speedup == pytest.approx(tokens / (cost.block(k + 1) + k * d) * v1)
    record = json.loads(json.dumps(cost.to_dict()))  # what goes into metrics.json
    assert record["fixed_s"] == cost.block.fixed_s and len(record["arms"]) == 2
    assert set(record["timings"]) == {"1", "2", "3", "4"}
    text = cost.describe()
    medians = ", ".join(f"{n}: {statistics.median(ts) * 1e3:.1f}" for n, ts in cost.timings.items())
    assert medians in text and "ngram@2" in text and "ngram@3" in text
    fig = cost_model_figure(cost)
    assert [t.name for t in fig.data][1:2] == ["median"] and len(fig.data) == 6
    assert [t.name for t in fig.data][-1] == "y = x"
    assert (
        run_speculative(
            default_model,
            {"ngram": NgramProposer},
            domain_conversations("chitchat", "dev", limit=1),
            SpeculativeSettings.for_cache(
                cache, draft_lengths=(2,), turns=1, max_new_tokens=2, measure_cost=False
            ),
            progress=False,
        ).cost
        is None
    )


@pytest.mark.slow
def test_cost_aware_arms_plan_with_the_runs_block_cost(default_model):
    convs = domain_conversations("code", "dev", limit=1)
    cache = SinkWindowConfig(sink=4, window=60)  # the code passage alone overflows it
    kw = dict(turns=1, max_new_tokens=16)
    settings = SpeculativeSettings.for_cache(
        cache, draft_lengths=(6,), cost_aware=True, cost_repeats=2, **kw
    )
    run = run_speculative(
        default_model, {"suffix-tree": SuffixTreeProposer}, convs, settings, progress=False
    )
    assert list(run.summary["arm"]) == ["plain", "suffix-tree@6", "suffix-tree@cost6"]
    assert greedy_streams_identical(run.turns)  # lossless under the schedule too
    planned = run.steps[run.steps["arm"] == "suffix-tree@cost6"]
    assert len(planned) and planned["proposed"].max() <= 6
    assert set(run.turns["proposer"]) == {"plain", "suffix-tree", "suffix-tree (cost-aware)"}
    with pytest.raises(ValueError, match="measure_cost"):
        SpeculativeSettings.for_cache(
            cache, draft_lengths=(2,), cost_aware=True, measure_cost=False, **kw
        )
