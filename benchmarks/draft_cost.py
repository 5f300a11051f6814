"""What a feature drafter's drafting costs per speculative step, on this machine.

    OMP_NUM_THREADS=2 python benchmarks/draft_cost.py --out FILE

Builds a feature drafter of the shape of the million-token drafter of docs/results.md (the default
model's width, one layer, 8 context pairs, a 4096-token draft vocabulary) with seeded
random weights, sharpened (``--sharpen``) so that, like a trained drafter, it is confident
enough for its EAGLE-2 tree to grow deep; reads real features from the default verifier's
hidden-state trace after a chat context; and times a 3-token chain (``draft``) and an
8-node tree with 4 children a node (``draft_tree``), interleaved, ``--repeats`` times after
one untimed call each. Prints medians in ms and the depth of the trees. Random weights: a
timing, never a quality number. Run it in two checkouts to compare implementations.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kakeya_lab import SinkWindowConfig, Verifier, load_model
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.data import domain_conversations
from kakeya_lab.durable import write_json_atomic
from kakeya_lab.proposers.drafters.network import DrafterConfig, build_drafter
from kakeya_lab.results import now_iso


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context-len", type=int, default=8)
    parser.add_argument("--draft-vocab", type=int, default=4096)
    parser.add_argument("--sharpen", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    started = now_iso()
    loaded = load_model(args.model, progress=False)
    cfg = loaded.model.config
    torch.manual_seed(0)
    drafter = build_drafter(
        DrafterConfig(
            kind="feature",
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            verifier_sha256=loaded.description.weight_sha256,
            draft_vocab=list(range(args.draft_vocab)),
            context_len=args.context_len,
        ),
        loaded.model,
    )
    with torch.no_grad():
        drafter.out.weight.mul_(args.sharpen)

    verifier = Verifier(loaded.model, SinkWindowConfig(sink=4, window=1020))
    trace = verifier.trace_hidden()
    chat = ChatTemplate(loaded.tokenizer)
    conv = domain_conversations("chitchat", "dev", limit=1)[0]
    verifier.append(chat.user(conv.turns[0]) + chat.assistant(conv.turns[1]))
    history = verifier.history_token_ids
    n = args.context_len
    positions = range(len(history) - n - 1, len(history) - 1)
    feats = trace.features(positions, [history[p] for p in positions])
    assert feats is not None
    next_tokens = history[-n:]

    calls = {
        "chain3_ms": lambda: drafter.draft(feats, next_tokens, 3),
        "tree8_ms": lambda: drafter.draft_tree(feats, next_tokens, 8, branch=4),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.repeats + 1):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            if r:  # round 0 warms up
                times[name].append((time.perf_counter() - t0) * 1e3)
    tree = drafter.draft_tree(feats, next_tokens, 8, branch=4)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"draft chain of 3: {med['chain3_ms']:.2f} ms; tree of 8 nodes (depth {tree.depth}): "
        f"{med['tree8_ms']:.2f} ms  (median of {args.repeats}, torch threads "
        f"{torch.get_num_threads()})"
    )
    write_json_atomic(
        args.out,
        {
            "model": loaded.description.name,
            "weight_sha256": loaded.description.weight_sha256,
            "drafter": drafter.config.to_dict() | {"draft_vocab": args.draft_vocab},
            "sharpen": args.sharpen,
            "tree_depth": tree.depth,
            "torch_threads": torch.get_num_threads(),
            "started": started,
            "finished": now_iso(),
            "median_ms": med,
            "timings_ms": times,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
