"""What a draft model's one-token step costs on each linear kernel, and what int8 changes.

    OMP_NUM_THREADS=2 python benchmarks/draft_model_cost.py --out FILE

Loads a draft model (``--model``, in ``--dtype``), fills a sink-window cache with real code
context (``--window``), and times one-token steps (a provisional block of one token, rolled
back) and a prefill of ``--prefill`` tokens (a new user turn; rolled back) with its linear layers on each kernel of ``kakeya_lab/linear.py`` — PyTorch's default,
oneDNN's, and int8 weights — switched between calls on the same loaded weights, interleaved
round by round after one untimed round; each one-token step is timed twice, through
transformers' forward and through the lean forward of ``kakeya_lab/backends/torch_lean.py`` (what a
draft model runs by default). Then it feeds ``--positions`` tokens of held-out
code one at a time on each kernel and reports how often the greedy next token equals
the default kernel's, through either forward: int8, int4 and the lean forward's rounding
change a draft's numbers, so this is the share of drafts they could lose. Prints medians in ms; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kakeya_lab import SinkWindowConfig, Verifier, load_model
from kakeya_lab.backends.torch_lean import LeanForward
from kakeya_lab.data import domain_conversations
from kakeya_lab.durable import write_json_atomic
from kakeya_lab.linear import KERNELS, check_linear_kernel, set_linear_kernel
from kakeya_lab.results import now_iso


def code_tokens(tokenizer, n: int, split: str) -> list[int]:
    """At least ``n`` token ids of the code domain's ``split`` (held-out files for ``dev``)."""
    ids: list[int] = []
    for conversation in domain_conversations("code", split):
        for turn in conversation.turns:
            ids += tokenizer(turn, add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the code {split} split has fewer than {n} tokens")


def runnable_kernels() -> list[str]:
    """The kernels of :data:`KERNELS` this machine runs as set (``auto`` needs a measured
    choice and is one of the others per call; ``int4-vnni`` needs AVX-512 VNNI)."""
    kernels = []
    for kernel in KERNELS:
        try:
            check_linear_kernel(kernel)
        except ValueError:
            continue
        if kernel != "auto":
            kernels.append(kernel)
    return kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    started = now_iso()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), progress=False)
    config = SinkWindowConfig(sink=4, window=args.window)
    verifier = Verifier(loaded.model, config)
    context = code_tokens(loaded.tokenizer, config.budget + args.prefill, "train")
    verifier.append(context[: config.budget])
    turn = context[config.budget :]

    kernels = runnable_kernels()
    lean_verifiers = {}
    for kernel in kernels:  # the fused projections are packed with the kernel
        set_linear_kernel(loaded.model, kernel)
        lean_verifiers[kernel] = Verifier(loaded.model, config, lean=True)
        assert isinstance(lean_verifiers[kernel].backend.lean_forward, LeanForward)
        lean_verifiers[kernel].append(context[: config.budget])
    times: dict[str, list[float]] = {k: [] for k in kernels}
    lean_times: dict[str, list[float]] = {k: [] for k in kernels}
    prefill: dict[str, list[float]] = {k: [] for k in kernels}
    for r in range(args.repeats + 1):
        for kernel in kernels:
            set_linear_kernel(loaded.model, kernel)
            for v, block, into in (
                (verifier, [100], times),
                (lean_verifiers[kernel], [100], lean_times),
                (verifier, turn, prefill),
            ):
                t0 = time.perf_counter()
                v.forward_block(block)
                v.rollback()
                if r:  # round 0 warms up
                    into[kernel].append(time.perf_counter() - t0)

    held_out = code_tokens(loaded.tokenizer, args.positions, "dev")
    greedy: dict[str, torch.Tensor] = {}
    for kernel in kernels:  # one token at a time, as a draft model runs (not a prefill)
        set_linear_kernel(loaded.model, kernel)
        for name, lean in ((kernel, False), (f"{kernel} lean", True)):
            scorer = Verifier(loaded.model, config, lean=lean)
            greedy[name] = torch.tensor([int(scorer.append([t]).argmax()) for t in held_out])
    set_linear_kernel(loaded.model, "aten")
    agree = {k: float((g == greedy["aten"]).float().mean()) for k, g in greedy.items()}

    med = {k: statistics.median(ts) for k, ts in times.items()}
    med_lean = {k: statistics.median(ts) for k, ts in lean_times.items()}
    med_prefill = {k: statistics.median(ts) for k, ts in prefill.items()}
    print(
        f"{loaded.description.name} ({args.dtype}), {verifier.cache_len} cached tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"kernel   one-token step ms  ×aten  lean step ms  lean/transformers  "
        f"prefill of {len(turn)} ms  greedy = aten's  lean greedy = aten's"
    )
    for kernel in kernels:
        print(
            f"{kernel:9s}  {med[kernel] * 1e3:17.1f}  {med[kernel] / med['aten']:5.2f}  "
            f"{med_lean[kernel] * 1e3:12.1f}  {med_lean[kernel] / med[kernel]:17.2f}  "
            f"{med_prefill[kernel] * 1e3:16.1f}  {agree[kernel]:15.1%}  "
            f"{agree[f'{kernel} lean']:20.1%}"
        )
    write_json_atomic(
        args.out,
        {
            "model": loaded.description.name,
            "weight_sha256": loaded.description.weight_sha256,
            "dtype": args.dtype,
            "cache": config.to_dict(),
            "cached_tokens": verifier.cache_len,
            "positions": args.positions,
            "torch_threads": torch.get_num_threads(),
            "started": started,
            "finished": now_iso(),
            "prefill_tokens": len(turn),
            "median_s": med,
            "lean_median_s": med_lean,
            "prefill_median_s": med_prefill,
            "timings_s": times,
            "lean_timings_s": lean_times,
            "prefill_timings_s": prefill,
            "greedy_agreement_with_aten": agree,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
