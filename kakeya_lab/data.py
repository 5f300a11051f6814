"""Prompt sets and corpora, all from installed packages (no downloads at run time).

Everything here is read from the installed ``kakeya_lab`` package or its dependencies,
never from the checkout or the running interpreter, so an installed wheel has every
domain and a split is the same on every machine and Python version.

Chit-chat: the MIT-licensed ``chitchat-dataset`` package (BYU PCC lab, ~7k real
two-person chats, ~19 turns each). Consecutive messages of one sender are joined into one
turn. **Split by conversation id**: a conversation is in ``dev`` iff the first 8 hex
digits of ``sha256(conversation_id)`` taken as an integer are ``0 mod 10`` (about 10%),
otherwise in ``train``. The rule is fixed here; ``data/chitchat_split.json`` lists the dev
ids it yields, and a test checks the two agree.

Code and prose (for per-domain evaluation of proposers, :func:`domain_conversations`):

* ``code``: passages of a pinned set of 30 small CPython 3.11.7 standard-library modules
  shipped as package data (``kakeya_lab/corpora/code/<module>.py.txt``, PSF licence in
  ``LICENSE-PSF.txt`` beside them), each passage starting at a top-level ``def``/``class``
  (at most 8 per file, 14 lines each); ``dev`` iff the same hash rule holds for the file
  name ``<module>.py`` (held out by file).
* ``prose``: passages of *The Tempest* (``kakeya_lab/corpora/tempest.txt``, public
  domain) of about 600 characters at blank lines; ``dev`` iff the rule holds for
  ``"tempest:<index>"``.

Each passage becomes a two-turn conversation: "continue this" with the passage, then
"Go on." — so every domain runs through the same chat-templated session path.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Literal

Split = Literal["train", "dev"]
DEV_BUCKETS = 10
REPO_DATA = Path(__file__).resolve().parent.parent / "data"  # the checkout's data/ (manifests only)
CODE_SUFFIX = ".py.txt"


def corpus_file(name: str):
    """A file shipped in ``kakeya_lab/corpora`` (an importlib Traversable)."""
    return resources.files("kakeya_lab").joinpath("corpora", name)


def tempest_text() -> str:
    """Shakespeare, *The Tempest* (complete play, public domain), as shipped."""
    return corpus_file("tempest.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[str, ...]  # alternating speakers, first speaker first
    domain: str = "chitchat"


DOMAINS = ("chitchat", "code", "prose")


def split_of(conversation_id: str) -> Split:
    """``dev`` for about one conversation in ten, by a hash of its id (stable forever)."""
    bucket = int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % DEV_BUCKETS
    return "dev" if bucket == 0 else "train"


@lru_cache(maxsize=1)
def _chitchat_raw() -> dict:
    try:
        import chitchat_dataset
    except ImportError as exc:  # pragma: no cover - a dependency of the dev/data extras
        raise ImportError(
            "the chit-chat corpus needs the 'chitchat-dataset' package: pip install chitchat-dataset==0.9.0"
        ) from exc
    path = Path(chitchat_dataset.__file__).with_name("dataset.json")
    return json.loads(path.read_text())


def chitchat_conversations(
    split: Split = "dev", *, limit: int | None = None, min_turns: int = 2
) -> list[Conversation]:
    """Conversations of ``split`` in a fixed order (sorted by id)."""
    if split not in ("train", "dev"):
        raise ValueError(f"split must be 'train' or 'dev', got {split!r}")
    raw = _chitchat_raw()
    out = []
    for cid in sorted(raw):
        if split_of(cid) != split:
            continue
        turns = tuple(
            " ".join(u["text"].strip() for u in group if u["text"].strip())
            for group in raw[cid]["messages"]
        )
        turns = tuple(t for t in turns if t)
        if len(turns) >= min_turns:
            out.append(Conversation(cid, turns))
        if limit is not None and len(out) >= limit:
            break
    return out


def chained_user_turns(conversations: list[Conversation], n_turns: int) -> list[str]:
    """The first speaker's turns of ``conversations`` one after another, ``n_turns`` of them
    (a long session made of real chats; cycles if the conversations run out)."""
    turns = [t for c in conversations for t in c.turns[0::2]]
    if not turns:
        raise ValueError("no user turns in these conversations")
    return [turns[i % len(turns)] for i in range(n_turns)]


def dev_ids_manifest() -> dict:
    """What ``data/chitchat_split.json`` holds: the rule and the dev ids it gives."""
    raw = _chitchat_raw()
    dev = sorted(cid for cid in raw if split_of(cid) == "dev")
    return {
        "rule": f"dev iff int(sha256(id)[:8], 16) % {DEV_BUCKETS} == 0",
        "source": "chitchat-dataset==0.9.0 (MIT)",
        "conversations": len(raw),
        "dev": dev,
    }


def code_files() -> list[str]:
    """The module file names of the shipped code corpus (``heapq.py``, ...), sorted."""
    folder = corpus_file("code")
    return sorted(p.name[: -len(".txt")] for p in folder.iterdir() if p.name.endswith(CODE_SUFFIX))


def _code_passages(max_lines: int = 14) -> list[tuple[str, str]]:
    """``(file name, passage)`` from the shipped code corpus, in a fixed order."""
    out = []
    for name in code_files():
        lines = corpus_file("code").joinpath(name + ".txt").read_text(encoding="utf-8").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))]
        for i in starts[:8]:  # a few passages per file keeps files balanced
            passage = "\n".join(lines[i : i + max_lines]).strip()
            if len(passage) > 80:
                out.append((name, passage))
    return out


def _prose_passages(target_chars: int = 600) -> list[str]:
    text = tempest_text()
    passages, current = [], ""
    for para in text.split("\n\n"):
        para = para.strip()
        if not para:
            continue
        current = f"{current}\n\n{para}" if current else para
        if len(current) >= target_chars:
            passages.append(current)
            current = ""
    return passages


def domain_conversations(
    domain: str, split: Split = "dev", *, limit: int | None = None
) -> list[Conversation]:
    """Prompt conversations of one domain (``chitchat``, ``code`` or ``prose``) and split."""
    if split not in ("train", "dev"):
        raise ValueError(f"split must be 'train' or 'dev', got {split!r}")
    if domain == "chitchat":
        return chitchat_conversations(split, limit=limit)
    if domain == "code":
        items = [(f"code:{name}:{i}", name, p) for i, (name, p) in enumerate(_code_passages())]
        prompt = "Continue this Python code.\n\n```python\n{}\n```"
    elif domain == "prose":
        items = [(f"prose:tempest:{i}", f"tempest:{i}", p) for i, p in enumerate(_prose_passages())]
        prompt = "Continue this passage of a play.\n\n{}"
    else:
        raise ValueError(f"unknown domain {domain!r}: use one of {', '.join(DOMAINS)}")
    out = []
    for cid, split_key, passage in items:
        if split_of(split_key) != split:
            continue
        out.append(Conversation(cid, (prompt.format(passage), "", "Go on."), domain=domain))
        if limit is not None and len(out) >= limit:
            break
    return out


def prompt_set_conversations(
    prompt_set: str, *, limit: int | None = None, min_turns: int = 2
) -> list[Conversation]:
    """The conversations a benchmark names as ``DOMAIN-SPLIT`` (``chitchat-dev``,
    ``code-dev``, ``prose-dev``; ``-train`` for the training side). Chit-chat keeps
    conversations with at least ``min_turns`` turns; a code or prose conversation is one
    passage and a "Go on." turn (2 user turns), whatever ``min_turns`` asks."""
    domain, _, split = prompt_set.rpartition("-")
    if domain not in DOMAINS or split not in ("train", "dev"):
        raise ValueError(
            f"unknown prompt set {prompt_set!r}: use DOMAIN-SPLIT with DOMAIN one of "
            f"{', '.join(DOMAINS)} and SPLIT dev or train (e.g. code-dev)"
        )
    if domain == "chitchat":
        return chitchat_conversations(split, limit=limit, min_turns=min_turns)  # type: ignore[arg-type]
    return domain_conversations(domain, split, limit=limit)  # type: ignore[arg-type]
