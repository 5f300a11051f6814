"""Verifier rollouts: what a drafter learns from (docs/design.md, "Proposer alignment").

Each conversation runs through the session runtime with the sink-window cache on: every
user turn is appended (chat-templated) and the verifier replies greedily
(``replies="generate"``), or the conversation's own replies are appended as assistant
turns (``replies="dataset"``: teacher forcing, one chunked prefill of the whole templated
conversation instead of a decode per token, so tens of times more positions per second; the
targets are still the verifier's distributions at every position). One dataset row
per conversation holds, for every token position ``i`` of the session:

* ``token_ids[i]`` and ``positions[i]`` (global position, ``== i``);
* ``generated[i]``: an assistant-reply token (the verifier's own, or the dataset's with
  ``replies="dataset"``); else prompt or template;
* ``hidden[i]``: the verifier's final hidden state at ``i`` (the lm_head input, float16);
* ``topk_ids[i]``, ``topk_logits[i]``: the verifier's ``top_k`` next-token logits at ``i``
  (they predict ``token_ids[i+1]``);
* ``loss_mask[i]``: train on the prediction at ``i`` (``False`` for low-confidence
  predictions when ``min_confidence`` is set).

Rows are written as ``datasets`` shards (Arrow) under ``out_dir/shard-NNNNN`` with a
``manifest.json`` (model sha256, cache config, split, options, finished shards and their
conversation ids, tokens and capture seconds), rewritten atomically after each shard, and
``stats`` (tokens per second, bytes on disk) when finished. Capture resumes from the
manifest: finished conversations are skipped, a half-written shard is discarded.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.bench.aggregate import repetition_rate
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.data import Conversation
from kakeya_lab.results import now_iso, write_json_atomic
from kakeya_lab.session import SessionStore, chat_turn, collect_reply

MANIFEST = "manifest.json"
SCHEMA = 1


class RolloutError(RuntimeError):
    """A rollout folder that cannot be used or resumed as asked."""


@dataclass(frozen=True)
class CaptureOptions:
    top_k: int = 20
    turns_per_conversation: int = 3
    max_new_tokens: int = 48
    shard_size: int = 8
    min_confidence: float | None = None  # mask predictions whose top-1 probability is lower
    max_repetition: float | None = 0.5  # drop conversations whose replies repeat more 4-grams
    system: str | None = None
    replies: str = "generate"  # or "dataset": append the conversation's own replies

    def __post_init__(self):
        if self.replies not in ("generate", "dataset"):
            raise ValueError(f"replies must be 'generate' or 'dataset', got {self.replies!r}")


def _features(top_k: int, hidden_size: int):
    import datasets

    return datasets.Features(
        {
            "conversation_id": datasets.Value("string"),
            "domain": datasets.Value("string"),
            "split": datasets.Value("string"),
            "token_ids": datasets.Sequence(datasets.Value("int32")),
            "positions": datasets.Sequence(datasets.Value("int32")),
            "generated": datasets.Sequence(datasets.Value("bool")),
            "loss_mask": datasets.Sequence(datasets.Value("bool")),
            "topk_ids": datasets.Array2D((None, top_k), "int32"),
            "topk_logits": datasets.Array2D((None, top_k), "float32"),
            "hidden": datasets.Array2D((None, hidden_size), "float16"),
        }
    )


def _save_quietly(dataset, path: Path) -> None:
    """``save_to_disk`` without its own progress bar (the capture has one)."""
    from datasets.utils import disable_progress_bars, enable_progress_bars, is_progress_bar_enabled

    was_enabled = is_progress_bar_enabled()
    disable_progress_bars()
    try:
        dataset.save_to_disk(str(path))
    finally:
        if was_enabled:
            enable_progress_bars()


def read_manifest(out: str | Path) -> dict | None:
    """The manifest of a rollout folder, or None when it has none."""
    import json

    out = Path(out)
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise RolloutError(
            f"{path} is not valid JSON ({exc}); remove the folder to start over"
        ) from exc


def capture_conversation(
    store: SessionStore, tokenizer, conversation: Conversation, split: str, options: CaptureOptions
) -> dict | None:
    """Run one conversation through a fresh session; its dataset row, or None if filtered."""
    tok_template = ChatTemplate(tokenizer, system=options.system)
    sid = store.create()
    try:
        verifier = store.verifier(sid)
        trace = verifier.trace_hidden(None)
        generated_at: list[int] = []
        replies: list[list[int]] = []
        pending: list[int] = []  # teacher forcing: the whole conversation is one append
        users, answers = conversation.turns[0::2], conversation.turns[1::2]
        for ti, text in enumerate(users[: options.turns_per_conversation]):
            if options.replies == "dataset":
                if not (ti < len(answers) and answers[ti].strip()):
                    break
                pending += tok_template.user(text)
                reply = tok_template.assistant(answers[ti])
                start = verifier.history_len + len(pending)
                pending += reply
            else:
                turn = chat_turn(store, sid, tok_template, text, options.max_new_tokens)
                start = verifier.history_len
                reply = collect_reply(turn).token_ids
            generated_at.extend(range(start, start + len(reply)))
            replies.append(reply)
        if pending:
            # the cache's chunked prefill equals turn-by-turn appends (the oracle rule),
            # and one call skips a forward's fixed cost per turn
            store.append(sid, pending)
        tokens = verifier.history_token_ids
        hidden = trace.features(range(len(tokens)), tokens)
    finally:
        store.close(sid)
    if hidden is None:
        raise RolloutError(f"conversation {conversation.id}: the trace lost hidden states")
    if options.max_repetition is not None:
        rep = max((repetition_rate(r) for r in replies), default=0.0)
        if rep > options.max_repetition:
            return None
    with torch.no_grad():
        logits = store.model.get_output_embeddings()(
            hidden.to(next(store.model.parameters()).dtype)
        ).float()
    top = torch.topk(logits, options.top_k, dim=-1)
    mask = torch.ones(len(tokens), dtype=torch.bool)
    if options.min_confidence is not None:
        mask = torch.softmax(logits, dim=-1).amax(dim=-1) >= options.min_confidence
    generated = torch.zeros(len(tokens), dtype=torch.bool)
    generated[generated_at] = True
    return {
        "conversation_id": conversation.id,
        "domain": conversation.domain,
        "split": split,
        "token_ids": tokens,
        "positions": list(range(len(tokens))),
        "generated": generated.tolist(),
        "loss_mask": mask.tolist(),
        "topk_ids": top.indices.to(torch.int32).numpy(),
        "topk_logits": top.values.numpy(),
        "hidden": hidden.to(torch.float16).numpy(),
    }


def capture_rollouts(
    loaded,
    conversations: Sequence[Conversation],
    out_dir: str | Path,
    *,
    config: SinkWindowConfig,
    split: str,
    options: CaptureOptions = CaptureOptions(),
    progress: bool = True,
    on_shard: Callable[[int], None] | None = None,
) -> dict:
    """Capture rollouts of ``conversations`` into ``out_dir``; return the manifest.

    Resumable: run again with the same arguments after an interruption and only the
    conversations not in a finished shard are captured. A folder made for another model,
    cache, split or options is refused. ``on_shard(i)`` is called after shard ``i`` is
    finished (for progress reporting).
    """
    import datasets

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    identity = {
        "schema": SCHEMA,
        "model": loaded.description.name,
        "weight_sha256": loaded.description.weight_sha256,
        "vocab_size": loaded.model.get_input_embeddings().num_embeddings,
        "hidden_size": loaded.model.config.hidden_size,
        "cache": config.to_dict(),
        "split": split,
        "options": asdict(options),
    }
    manifest = read_manifest(out)
    if manifest is None:
        manifest = {**identity, "shards": [], "started": now_iso(), "finished": None}
    else:
        differ = [k for k, v in identity.items() if manifest.get(k) != v]
        if differ:
            raise RolloutError(
                f"{out} holds rollouts made with other {', '.join(differ)}; "
                "use another folder or remove it"
            )
    done_ids = {cid for shard in manifest["shards"] for cid in shard["attempted"]}
    todo = [c for c in conversations if c.id not in done_ids]
    store = SessionStore(loaded.model, config, capacity=1)
    bar = tqdm(
        total=len(conversations),
        initial=len(conversations) - len(todo),
        desc="rollouts",
        unit="conv",
        disable=not progress,
    )
    for start in range(0, len(todo), options.shard_size):
        batch = todo[start : start + options.shard_size]
        t0 = time.perf_counter()
        rows = []
        for conv in batch:
            row = capture_conversation(store, loaded.tokenizer, conv, split, options)
            if row is not None:
                rows.append(row)
            bar.update(1)
        index = len(manifest["shards"])
        name = f"shard-{index:05d}"
        path = out / name
        if path.exists():  # left by an interrupted capture; never listed in the manifest
            shutil.rmtree(path)
        if rows:
            columns = {key: [r[key] for r in rows] for key in rows[0]}
            shard = datasets.Dataset.from_dict(
                columns, features=_features(options.top_k, identity["hidden_size"])
            )
            _save_quietly(shard, path)
        manifest["shards"].append(
            {
                "name": name if rows else None,
                "attempted": [c.id for c in batch],
                "rows": len(rows),
                "tokens": int(sum(len(r["token_ids"]) for r in rows)),
                "seconds": round(time.perf_counter() - t0, 3),
            }
        )
        write_json_atomic(out / MANIFEST, manifest)
        if on_shard is not None:
            on_shard(index)
    bar.close()
    manifest["finished"] = now_iso()
    manifest["stats"] = capture_stats(out, manifest)
    write_json_atomic(out / MANIFEST, manifest)
    return manifest


def capture_stats(out: str | Path, manifest: dict) -> dict:
    """Size and speed of a rollout folder: conversations, tokens, capture seconds (summed
    over shards, so resumed captures count only the work done), tokens per second and
    bytes on disk (the shards' Arrow files)."""
    shards = manifest["shards"]
    seconds = sum(s.get("seconds", 0.0) for s in shards)
    tokens = sum(s["tokens"] for s in shards)
    return {
        "conversations": sum(s["rows"] for s in shards),
        "tokens": tokens,
        "seconds": round(seconds, 3),  # a tiny model's shard can take well under 0.1 s
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "bytes": sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file()),
    }


def load_rollouts(*folders: str | Path):
    """The finished shards of one or more rollout folders as one ``datasets.Dataset``."""
    import datasets

    parts = []
    for folder in folders:
        folder = Path(folder)
        manifest = read_manifest(folder)
        if manifest is None:
            raise RolloutError(f"{folder} has no {MANIFEST}: not a rollout folder")
        for shard in manifest["shards"]:
            if shard["name"]:
                parts.append(datasets.load_from_disk(str(folder / shard["name"])))
    if not parts:
        raise RolloutError(f"no rollout rows in {', '.join(map(str, folders))}")
    return datasets.concatenate_datasets(parts).with_format("numpy")


def draft_vocabulary(dataset, size: int, always: Sequence[int] = ()) -> list[int]:
    """The ``size`` token ids the rollouts use most (tokens and the verifier's top-1
    predictions), plus ``always`` (e.g. end-of-turn ids); sorted."""
    import numpy as np

    counts: dict[int, int] = {}
    for row in dataset:
        ids = np.concatenate([np.asarray(row["token_ids"]), np.asarray(row["topk_ids"])[:, 0]])
        uniq, n = np.unique(ids, return_counts=True)
        for t, c in zip(uniq.tolist(), n.tolist()):
            counts[t] = counts.get(t, 0) + c
    top = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return sorted(set(top) | {int(t) for t in always})
