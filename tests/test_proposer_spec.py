"""The proposer spec grammar (kakeya_lab/proposers/registry.py), checked without a model: the
leaves a spec names, a draft model's kernel suffix, and the errors bad specs get. Building
proposers from specs is tested with models in test_speculative, test_fallback, test_tree and
test_linear (the int4 suffix)."""

from __future__ import annotations

import pytest

from kakeya_lab.proposers import check_proposer_spec, draft_model_spec


def test_leaves_of_well_formed_specs():
    assert check_proposer_spec(None) == check_proposer_spec("none") == []
    assert check_proposer_spec("ngram:3,2") == [("ngram", "3,2")]
    assert check_proposer_spec("tree:suffix:6") == [("suffix", "6")]
    assert check_proposer_spec("suffix+draft:smollm2-135m-instruct:int4") == [
        ("suffix", ""),
        ("draft", "smollm2-135m-instruct:int4"),
    ]
    assert check_proposer_spec("drafter-tree:mine") == [("drafter-tree", "mine")]


def test_a_draft_model_names_its_kernel_after_a_colon():
    assert draft_model_spec("qwen2.5-coder-0.5b-instruct:int4") == (
        "qwen2.5-coder-0.5b-instruct",
        "int4",
    )
    assert draft_model_spec("smollm2-135m-instruct") == ("smollm2-135m-instruct", None)
    # a last part that is not a kernel stays in the model's name (a folder may hold a colon)
    assert draft_model_spec("/models/run:7") == ("/models/run:7", None)
    assert draft_model_spec("/models/run:7:int8") == ("/models/run:7", "int8")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("oracle", "unknown proposer 'oracle'"),
        ("early-exit:x", "bad layer count"),
        ("ngram:3,x", "bad n-gram sizes"),
        ("suffix:0", "bad suffix depth"),
        ("suffix-tree:65", "bad suffix depth"),
        ("draft:", "no draft model"),
        ("draft::int4", "no draft model"),
        ("drafter:", "no drafter name"),
        ("tree:", "wraps one chain proposer"),
        ("tree:suffix-tree", "wraps one chain proposer"),
        ("none+ngram", "two chain proposers"),
        ("ngram+drafter-tree:x", "two chain proposers"),
    ],
)
def test_bad_specs_say_how_to_write_them(spec, message):
    with pytest.raises(ValueError, match=message):
        check_proposer_spec(spec)
