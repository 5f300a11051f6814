"""The chit-chat corpus and its fixed split by conversation id."""

from __future__ import annotations

import json

from kakeya_lab.data import (
    REPO_DATA,
    chained_user_turns,
    chitchat_conversations,
    dev_ids_manifest,
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
