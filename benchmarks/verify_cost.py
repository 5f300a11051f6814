"""Where a speculative step's verification time goes, on this machine.

    OMP_NUM_THREADS=2 python benchmarks/verify_cost.py --out FILE

After a full cache of real chat context (``--window``), times the verifier's forward over a
provisional block of ``n`` tokens (then rolled back), for ``n = 1..--max-block``, in four
forms interleaved round by round: a chain (``forward_block``), the same chain with the
hidden-state trace a feature drafter reads switched on, a branching draft tree of ``n``
nodes (``forward_tree``, EAGLE-like: up to three children per node) with the trace, and
the lm_head alone over ``n`` rows (the share of a block that scores every row); and the
chain and tree again with the model's linear layers on oneDNN's kernel instead of PyTorch's
default (``kakeya_lab/linear.py``; the same weights, switched between calls). One untimed
round first. Prints medians and the ratios against a chain of the same size and
against the one-token step; a benchmark, not a test.
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
from kakeya_lab.linear import set_linear_kernel
from kakeya_lab.results import now_iso
from kakeya_lab.tree import DraftTree


def branching_tree(n: int, width: int = 3) -> DraftTree:
    """``n`` nodes, the root first, filled breadth-first with ``width`` children a node."""
    parents = [-1] + [(i - 1) // width for i in range(1, n)]
    return DraftTree([100 + i for i in range(n)], parents)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--max-block", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    started = now_iso()
    loaded = load_model(args.model, progress=False)
    config = SinkWindowConfig(sink=4, window=args.window)
    plain = Verifier(loaded.model, config)
    traced = Verifier(loaded.model, config)
    traced.trace_hidden()
    ctx = ChatTemplate(loaded.tokenizer).replay(
        (c.turns for c in domain_conversations("chitchat", "dev")), config.budget
    )
    plain.append(ctx)
    traced.append(ctx)
    head = loaded.model.get_output_embeddings().weight.detach()
    hidden = torch.randn(args.max_block, head.shape[1])

    def chain(v: Verifier, n: int) -> None:
        v.forward_block([100 + i for i in range(n)])
        v.rollback()

    def tree(n: int) -> None:
        traced.forward_tree(branching_tree(n))
        traced.rollback()

    def lm_head(n: int) -> None:
        with torch.inference_mode():
            hidden[:n] @ head.T

    def onednn(run):
        def timed(n: int) -> None:
            set_linear_kernel(loaded.model, "onednn")
            try:
                run(n)
            finally:
                set_linear_kernel(loaded.model, "aten")

        return timed

    forms = {
        "chain": lambda n: chain(plain, n),
        "chain_traced": lambda n: chain(traced, n),
        "tree_traced": tree,
        "lm_head": lm_head,
        "chain_onednn": onednn(lambda n: chain(plain, n)),
        "tree_traced_onednn": onednn(tree),
    }
    sizes = list(range(1, args.max_block + 1))
    times: dict[str, dict[int, list[float]]] = {f: {n: [] for n in sizes} for f in forms}
    for r in range(args.repeats + 1):
        for n in sizes:
            for name, run in forms.items():
                t0 = time.perf_counter()
                run(n)
                if r:  # round 0 warms up
                    times[name][n].append(time.perf_counter() - t0)
    med = {f: {n: statistics.median(ts) for n, ts in by.items()} for f, by in times.items()}
    one = med["chain"][1]
    print(
        f"{loaded.description.name}, {len(ctx)} context tokens, torch threads {torch.get_num_threads()}"
    )
    one_dnn = med["chain_onednn"][1]
    print(
        " n  chain ms  ×v(1)  traced/chain  tree/chain  lm_head ms  lm_head share"
        "  onednn chain ms  ×v(1)  onednn tree ms"
    )
    for n in sizes:
        c, d = med["chain"][n], med["chain_onednn"][n]
        print(
            f"{n:2d}  {c * 1e3:8.2f}  {c / one:5.2f}  {med['chain_traced'][n] / c:12.3f}  "
            f"{med['tree_traced'][n] / c:10.3f}  {med['lm_head'][n] * 1e3:10.2f}  "
            f"{med['lm_head'][n] / c:13.1%}  {d * 1e3:15.2f}  {d / one_dnn:5.2f}  "
            f"{med['tree_traced_onednn'][n] * 1e3:14.2f}"
        )
    write_json_atomic(
        args.out,
        {
            "model": loaded.description.name,
            "weight_sha256": loaded.description.weight_sha256,
            "context_tokens": len(ctx),
            "cache": config.to_dict(),
            "torch_threads": torch.get_num_threads(),
            "started": started,
            "finished": now_iso(),
            "median_s": {f: {str(n): s for n, s in by.items()} for f, by in med.items()},
            "timings_s": {f: {str(n): ts for n, ts in by.items()} for f, by in times.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
