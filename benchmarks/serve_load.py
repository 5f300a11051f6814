"""Benchmark: N concurrent sessions x M turns against a running ``kakeya-lab serve``.

Each session appends a few token ids per turn and streams a short greedy reply through the
project's gRPC client (one thread and channel per session). Prints throughput (turns/s,
generated tokens/s) and per-turn latency p50/p95/p99, and checks that no session is left
open on the server afterwards.

    taskset -c 0 kakeya-lab serve --grpc-port 50061 --http-port 8061 --capacity 16 &
    taskset -c 0 python benchmarks/serve_load.py --grpc 127.0.0.1:50061 --http http://127.0.0.1:8061 \
        --sessions 16 --turns 100

The CI-sized form (8 x 50, replies checked against a sequential in-process run) is
``tests/test_serve_load.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from kakeya_lab.serve.load import latency_summary, load_conversations, run_load


def _open_sessions(http_base: str) -> int:
    return int(httpx.get(f"{http_base}/health", timeout=30).json()["sessions"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc", required=True, help="the server's gRPC HOST:PORT")
    parser.add_argument("--http", required=True, help="the server's http://HOST:PORT")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--tokens-per-turn", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the summary here (JSON)")
    args = parser.parse_args(argv)

    before = _open_sessions(args.http)
    conversations = load_conversations(
        args.sessions, args.turns, tokens_per_turn=args.tokens_per_turn, seed=args.seed
    )
    result = run_load(args.grpc, conversations, args.max_new_tokens)
    summary = latency_summary(result)
    summary["open_sessions_before"] = before
    summary["open_sessions_after"] = _open_sessions(args.http)
    summary["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    print(
        f"{summary['sessions']} sessions x {args.turns} turns: {summary['turns']} turns, "
        f"{summary['generated_tokens']} tokens in {summary['wall_s']:.1f}s = "
        f"{summary['turns_per_s']:.2f} turns/s, {summary['tokens_per_s']:.2f} tokens/s; "
        f"turn latency p50 {summary['turn_p50_s']:.3f}s p95 {summary['turn_p95_s']:.3f}s "
        f"p99 {summary['turn_p99_s']:.3f}s; open sessions {before} -> {summary['open_sessions_after']}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["open_sessions_after"] == before else 1


if __name__ == "__main__":
    sys.exit(main())
