"""Benchmark: kakeya_lab's MLX sink-window cache against mlx-lm's own ``RotatingKVCache``.

Two questions, one run, default model on MLX (CPU on Linux, Metal on Apple silicon):

1. The anchor: does speculative decoding over each cache stay equal to greedy decoding of
   that same cache once the window has wrapped? (mlx-lm's departs; ours must not.)
2. The cost: one decode step at the same live length (``sink + window`` entries), ours
   against ``RotatingKVCache``, as a ratio measured interleaved in one process
   (target <= 1.10x). Backend-internal ratio, not a speedup.

    python benchmarks/mlx_rotating_anchor.py [--window 1020] [--anchor-window 60]

Prints both results and writes them as JSON next to ``--out`` if given.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from kakeya_lab.bench.rotating_anchor import run_rotating_anchor, time_decode_step
from kakeya_lab.data import tempest_text
from kakeya_lab.durable import write_json_atomic
from kakeya_lab.models import DEFAULT_MODEL, load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--anchor-window", type=int, default=60, help="window of the anchor run")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020, help="window of the decode-step timing")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args(argv)

    loaded = load_model(args.model, backend="mlx", progress=False)
    prompt = loaded.tokenizer(tempest_text()[:4000], add_special_tokens=False)["input_ids"]
    prompt = prompt[: 3 * (args.sink + args.anchor_window)]  # well past the budget
    anchor = run_rotating_anchor(
        loaded.model,
        prompt,
        sink=args.sink,
        window=args.anchor_window,
        new_tokens=args.new_tokens,
        num_draft_tokens=args.draft_tokens,
    )
    print(anchor.summary())
    timing = time_decode_step(
        loaded.model, sink=args.sink, window=args.window, steps=args.steps, rounds=args.rounds
    )
    print(
        f"decode step at {timing.live_len} live entries ({timing.steps} steps in {args.rounds} interleaved rounds, "
        f"medians): RotatingKVCache {timing.rotating_s * 1e3:.1f} ms, ours (forward + commit) "
        f"{timing.ours_cache_s * 1e3:.1f} ms = {timing.ratio_cache:.2f}x, ours through "
        f"Verifier.append {timing.ours_verifier_s * 1e3:.1f} ms = {timing.ratio_verifier:.2f}x"
    )
    if args.out is not None:
        write_json_atomic(
            args.out,
            {
                "model": loaded.description.to_dict(),
                "anchor": anchor.to_dict(),
                "decode_step": asdict(timing),
            },
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
