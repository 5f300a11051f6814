"""Every experiment family's settings: one frozen value, validated once on construction
(a SettingsError naming the field), round-tripped through JSON as run folders record it,
and the one run-folder writer (``results.write_run``)."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from kakeya_lab.align.settings import AlignmentSettings
from kakeya_lab.bench.long_run.settings import LongRunSettings
from kakeya_lab.bench.speculative_settings import SpecTableSettings, SpeculativeSettings
from kakeya_lab.results import validate_metrics, write_run
from kakeya_lab.settings import SettingsError

FAMILIES = {
    LongRunSettings: ({"turns": 0}, "turns"),
    SpeculativeSettings: ({"draft_lengths": (0,)}, "draft_lengths"),
    SpecTableSettings: ({"arms": ("ngram",)}, "arms"),
    AlignmentSettings: ({"steps": {"feature": 5}}, "steps"),
}


def _perplexity():
    from kakeya_lab.bench.perplexity import PerplexitySettings  # imports torch

    return PerplexitySettings


@pytest.mark.parametrize("family", [*FAMILIES, "perplexity"], ids=lambda f: str(f))
def test_settings_round_trip_through_json_and_are_frozen(family):
    family = _perplexity() if family == "perplexity" else family
    settings = family()
    doc = json.loads(json.dumps(settings.to_dict()))  # as metrics.json keeps it
    assert family.from_dict(doc) == settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.sink = 1  # type: ignore[misc]
    with pytest.raises(SettingsError, match="unknown to"):
        family.from_dict({**doc, "no_such_setting": 1})


@pytest.mark.parametrize("family", list(FAMILIES), ids=lambda f: f.__name__)
def test_a_setting_that_cannot_work_is_refused_on_construction(family):
    bad, field = FAMILIES[family]
    with pytest.raises(SettingsError) as caught:
        family(**bad)
    assert caught.value.field == field
    # control: a valid change is accepted, and replace() validates again
    assert family().replace(sink=3).sink == 3
    with pytest.raises(SettingsError):
        family().replace(**bad)


def test_spec_table_settings_give_valid_per_set_settings():
    table = SpecTableSettings(arms=("ngram@2", "suffix-tree@3"), prompt_sets=("code-dev",))
    run = table.speculative("code-dev")
    assert run.proposers == ("ngram@2", "suffix-tree@3") and run.draft_lengths == ()
    assert run.prompt_set == "code-dev" and run.window == table.window


def test_the_verifiers_kernel_is_a_full_precision_one_and_mlx_loads_its_own():
    assert SpeculativeSettings(linear="auto").model_linear() == "auto"
    assert SpeculativeSettings(backend="mlx", linear="auto").model_linear() == "aten"
    # a quantised verifier would be another model than the plain decoding timed beside it
    for bad in ("int4", "fastest", ""):
        with pytest.raises(SettingsError) as caught:
            SpeculativeSettings(linear=bad)
        assert caught.value.field == "linear"
    with pytest.raises(SettingsError) as caught:  # the table checks it through its per-set runs
        SpecTableSettings(linear="int8")
    assert caught.value.field == "linear"
    assert SpecTableSettings(linear="exact").speculative("code-dev").linear == "exact"


def test_served_and_in_process_arms_are_checked_apart():
    assert LongRunSettings(arms=(), served_arms=("grpc_session",)).served_arms == ("grpc_session",)
    with pytest.raises(SettingsError, match="no arms given"):
        LongRunSettings(arms=(), served_arms=())
    with pytest.raises(SettingsError, match="unknown arm"):
        LongRunSettings(served_arms=("sink_window",))
    with pytest.raises(SettingsError, match="speculative"):
        LongRunSettings(proposer="ngram")  # no speculative arm to use it


def test_write_run_writes_metrics_and_tables(tmp_path):
    header = {
        "schema_version": 1,
        "experiment": "x",
        "run_id": "r",
        "model": {"name": "m", "weight_sha256": "0" * 64, "architecture": None, "random": False},
        "backend": "torch",
        "dtype": "float32",
        "sink": 4,
        "window": 8,
        "positions": "global",
        "proposer": None,
        "seed": None,
        "git_commit": None,
        "packages": {},
        "hardware": {"cpu": "x", "cpu_count": 1},
        "started": "2026-01-01T00:00:00+00:00",
        "ended": None,
    }
    path = write_run(
        tmp_path, header, {"a": 1}, headline={"a": 1}, tables={"t": pd.DataFrame({"x": [1, 2]})}
    )
    validate_metrics(json.loads(path.read_text()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "t.csv"]
    assert list(pd.read_csv(tmp_path / "t.csv")["x"]) == [1, 2]
