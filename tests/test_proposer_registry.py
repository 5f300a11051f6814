"""The proposer registry: every registered kind is checked, built and run losslessly past
eviction (so registering a kind tests it), and a kind registered from outside the package
works wherever a spec does."""

from __future__ import annotations

import pytest

from kakeya_lab import SinkWindowConfig
from kakeya_lab.proposers import (
    Draft,
    ProposerKind,
    check_proposer_spec,
    make_proposer,
    proposer_kind,
    proposer_kinds,
    register_proposer,
    unregister_proposer,
    usage,
)
from kakeya_lab.session import SessionStore, collect_reply

CONFIG = SinkWindowConfig(sink=4, window=36)  # the prompt and reply outgrow it: eviction
MAX_NEW = 24


class RepeatTail:
    """A model-free proposer of the test's own: drafts the history's last tokens again."""

    name = "repeat-tail"

    def __init__(self, width: int = 2):
        self.width = width

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        return Draft(list(context[-self.width :])[:draft_length], None, 0.0)

    def accept(self, n: int) -> None:
        return None

    def describe(self) -> dict:
        return {"name": self.name, "width": self.width}


def _check_width(spec: str, argument: str) -> None:
    if argument and not argument.isdigit():
        raise ValueError(f"bad width in {spec!r}: write it like repeat-tail:2")


@pytest.fixture
def repeat_tail():
    """``repeat-tail[:WIDTH]`` registered for one test, removed after it."""
    kind = register_proposer(
        ProposerKind(
            name="repeat-tail",
            usage="repeat-tail[:WIDTH]",
            summary="the history's last tokens again",
            build=lambda argument, request: RepeatTail(int(argument or 2)),
            check=_check_width,
        )
    )
    yield kind
    unregister_proposer(kind.name)


def _reply(store: SessionStore, prompt: list[int], proposer, turns: int = 2) -> list[list[int]]:
    sid = store.create()
    replies = []
    for turn in range(turns):
        store.append(sid, prompt[turn * 30 : (turn + 1) * 30] or prompt[:8])
        events = store.generate(sid, MAX_NEW, proposer=proposer, draft_length=4)
        replies.append(collect_reply(events).token_ids)
    assert store.info(sid).history_len > CONFIG.budget  # the history outgrew the cache
    store.close(sid)
    return replies


def _runnable(kind: ProposerKind) -> bool:
    return kind.needs in ("nothing", "verifier", "draft model")


@pytest.fixture(scope="module")
def plain_replies(default_model, text_ids):
    store = SessionStore(default_model.model, CONFIG)
    return _reply(store, text_ids[:60], None)


@pytest.mark.slow
@pytest.mark.parametrize("name", [k.name for k in proposer_kinds()])
def test_every_registered_kind_is_lossless_past_eviction(
    name, default_model, text_ids, plain_replies
):
    kind = proposer_kind(name)
    if not _runnable(kind):
        pytest.skip(f"{name} needs a trained drafter in the store (test_named_drafters)")
    proposer = make_proposer(kind.example, default_model.model, CONFIG, default_model.tokenizer)
    store = SessionStore(default_model.model, CONFIG)
    assert _reply(store, text_ids[:60], proposer) == plain_replies


def test_every_kind_declares_a_well_formed_example():
    names = [k.name for k in proposer_kinds()]
    assert len(names) == len(set(names))
    for kind in proposer_kinds():
        assert kind.usage in usage()
        leaves = check_proposer_spec(kind.example)  # raises for a malformed example
        if kind.wraps:  # its example wraps another kind: that one is the leaf
            assert len(leaves) == 1 and leaves[0][0] != kind.name
        else:
            assert [name for name, _ in leaves] == [kind.name]


@pytest.mark.slow
def test_a_kind_registered_outside_the_package_works_like_a_builtin(
    repeat_tail, default_model, text_ids, plain_replies
):
    assert "repeat-tail[:WIDTH]" in usage()
    assert check_proposer_spec("suffix+repeat-tail:3") == [("suffix", ""), ("repeat-tail", "3")]
    with pytest.raises(ValueError, match="bad width"):
        check_proposer_spec("repeat-tail:x")
    proposer = make_proposer("repeat-tail:3", default_model.model, CONFIG)
    assert isinstance(proposer, RepeatTail) and proposer.width == 3
    store = SessionStore(default_model.model, CONFIG)
    assert _reply(store, text_ids[:60], proposer) == plain_replies
    tree = make_proposer("tree:repeat-tail", default_model.model, CONFIG)
    assert tree.name == "tree:repeat-tail"


def test_a_removed_kind_is_unknown_again(repeat_tail):
    unregister_proposer(repeat_tail.name)
    with pytest.raises(ValueError, match="unknown proposer 'repeat-tail'"):
        check_proposer_spec("repeat-tail")
    register_proposer(repeat_tail)  # the fixture removes it again


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (dict(name="none"), "bad proposer kind name"),
        (dict(name="has space"), "bad proposer kind name"),
        (dict(name="x", needs="a gpu"), "needs must be one of"),
        (dict(name="x", build="no_colon"), "module:function"),
    ],
)
def test_bad_kinds_are_refused(kind, message):
    fields = dict(usage="x", summary="x", build=lambda a, r: None) | kind
    with pytest.raises(ValueError, match=message):
        ProposerKind(**fields)


def test_a_name_is_registered_once_unless_replaced(repeat_tail):
    other = ProposerKind(name="repeat-tail", usage="u", summary="s", build=lambda a, r: None)
    with pytest.raises(ValueError, match="already registered"):
        register_proposer(other)
    register_proposer(other, replace=True)
    assert proposer_kind("repeat-tail") is other


def test_listing_and_checking_kinds_imports_no_tensor_library():
    """The command line checks specs before anything heavy loads: the registry, the
    package's kind declarations and the protocols import neither torch nor transformers."""
    import subprocess
    import sys

    code = (
        "import sys; from kakeya_lab.proposers import check_proposer_spec, proposer_kinds; "
        "assert proposer_kinds(); check_proposer_spec('suffix+draft:m:int4'); "
        "print(sorted(m for m in ('torch', 'transformers', 'mlx') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_the_docs_table_is_the_registry():
    """docs/extending.md lists the package's kinds exactly as the registry declares them."""
    from pathlib import Path

    from kakeya_lab.proposers.registry import kinds_table

    page = (Path(__file__).resolve().parent.parent / "docs" / "extending.md").read_text()
    assert kinds_table() in page
