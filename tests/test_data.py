"""The prompt corpora (chit-chat, code, prose) and their fixed splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kakeya_lab.data import (
    REPO_DATA,
    chained_user_turns,
    chitchat_conversations,
    dev_ids_manifest,
    prompt_set_conversations,
    split_of,
)


def test_committed_split_matches_the_rule():
    committed = json.loads((REPO_DATA / "chitchat_split.json").read_text())
    assert committed == dev_ids_manifest()
    assert all(split_of(cid) == "dev" for cid in committed["dev"])
    assert 0.07 < len(committed["dev"]) / committed["conversations"] < 0.13


def test_train_and_dev_are_disjoint_real_conversations():
    dev = chitchat_conversations("dev")
    train_ids = {c.id for c in chitchat_conversations("train", limit=500)}
    assert dev and not train_ids & {c.id for c in dev}
    assert all(len(c.turns) >= 2 and all(t.strip() for t in c.turns) for c in dev)
    turns = chained_user_turns(dev[:2], 5)
    assert len(turns) == 5 and turns[0] == dev[0].turns[0]


def test_code_and_prose_come_from_the_package_with_a_fixed_split():
    import kakeya_lab
    from kakeya_lab.data import code_files, corpus_file, domain_conversations, tempest_text

    package = Path(kakeya_lab.__file__).parent
    assert Path(str(corpus_file("tempest.txt"))).resolve().is_relative_to(package)
    assert "Prospero" in tempest_text()
    files = code_files()
    assert len(files) == 30 and (package / "corpora" / "code" / "LICENSE-PSF.txt").is_file()
    # held out by file: the dev files are exactly the ones the hash rule picks, fixed forever
    assert [f for f in files if split_of(f) == "dev"] == [
        "colorsys.py",
        "getopt.py",
        "py_compile.py",
        "quopri.py",
        "types.py",
    ]
    for split in ("train", "dev"):
        convs = domain_conversations("code", split)
        assert convs and all(split_of(c.id.split(":")[1]) == split for c in convs)
        assert all(c.turns[0].startswith("Continue this Python code.") for c in convs)
    dev_prose = domain_conversations("prose", "dev")
    assert dev_prose and all(split_of(c.id.split(":", 1)[1]) == "dev" for c in dev_prose)
    train_ids = {c.id for c in domain_conversations("code", "train")}
    assert not train_ids & {c.id for c in domain_conversations("code", "dev")}


def test_prompt_sets_name_a_domain_and_a_split():
    for domain in ("code", "prose"):
        dev = prompt_set_conversations(f"{domain}-dev", limit=3)
        train = prompt_set_conversations(f"{domain}-train", limit=50)
        assert len(dev) == 3 and all(c.domain == domain for c in dev)
        assert {c.id for c in dev}.isdisjoint(c.id for c in train)
        assert all(len(c.turns[0::2]) == 2 for c in dev)  # passage, then "Go on."
    chat = prompt_set_conversations("chitchat-dev", limit=2, min_turns=6)
    assert [c.id for c in chat] == [
        c.id for c in chitchat_conversations("dev", limit=2, min_turns=6)
    ]
    for bad in ("chitchat", "code-test", "poetry-dev", ""):
        with pytest.raises(ValueError, match="DOMAIN-SPLIT"):
            prompt_set_conversations(bad)
