"""Benchmark: server overhead per generated token against in-process decoding.

One run, default model, one cache configuration: a ``kakeya-lab serve`` subprocess and an
in-process :class:`~kakeya_lab.session.SessionStore` over the same weights decode the same
prompt greedily, interleaved round by round (in-process, gRPC streaming, HTTP streaming),
so all three share machine conditions. Per-token decode latency is measured where a client
sees tokens arrive: ``(t_last - t_first) / (n - 1)`` over the token events of one reply
(the in-process store's iterator, the gRPC client's stream, the SSE chunks of
``/v1/chat/completions``); prefill and the first token are excluded. Prints medians over
the rounds and the ratios served / in-process (target <= 1.05).

    taskset -c 0 python benchmarks/serve_overhead.py [--rounds 7] [--new-tokens 48] [--out FILE]

Pin it to one core (``taskset -c 0``): the server subprocess inherits the affinity, so the
in-process and served decoders compete for the same core the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from kakeya_lab.cache import SinkWindowConfig
from kakeya_lab.models import DEFAULT_MODEL, load_model
from kakeya_lab.serve.client import SessionClient
from kakeya_lab.serve.process import start_server
from kakeya_lab.session import SessionStore, Token

PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "out loud as his father had taught him. At the top he"
)


def per_token(stamps: list[float]) -> float:
    if len(stamps) < 2:
        raise RuntimeError(f"only {len(stamps)} token(s) arrived: cannot time decoding")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def in_process(store: SessionStore, ids: list[int], n: int) -> tuple[float, int]:
    sid = store.create()
    try:
        store.append(sid, ids)
        stamps = [time.perf_counter() for e in store.generate(sid, n) if isinstance(e, Token)]
    finally:
        store.close(sid)
    return per_token(stamps), len(stamps)


def grpc_stream(client: SessionClient, ids: list[int], n: int) -> tuple[float, int]:
    sid = client.create()
    try:
        client.append_ids(sid, ids)
        stamps = [
            time.perf_counter() for e in client.stream(sid, n) if e.WhichOneof("event") == "token"
        ]
    finally:
        client.close_session(sid)
    return per_token(stamps), len(stamps)


def http_stream(http: httpx.Client, n: int) -> tuple[float, int]:
    """SSE chunks of a stateless request: one content chunk per token (prose; a token that
    ends inside a UTF-8 sequence would merge into the next chunk, making this an upper
    bound)."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "stream": True,
            "reuse": False}  # fmt: skip
    stamps: list[float] = []
    tokens = 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return per_token(stamps), tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    loaded = load_model(args.model, dtype=torch.float32)
    store = SessionStore(loaded.model, SinkWindowConfig(sink=args.sink, window=args.window))
    ids = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    ids = loaded.tokenizer(ids, add_special_tokens=False)["input_ids"]  # what HTTP renders
    server = start_server(
        "--sink", str(args.sink), "--window", str(args.window), model=args.model, timeout_s=300
    )
    grpc_target, http_base = server.grpc_target, server.http_base
    times: dict[str, list[float]] = {"in_process": [], "grpc_stream": [], "http_stream": []}
    counts: dict[str, list[int]] = {k: [] for k in times}
    try:
        with (
            SessionClient(grpc_target, timeout_s=600) as client,
            httpx.Client(base_url=http_base, timeout=600) as http,
        ):
            for _ in (0, 1):  # warm-up, not timed
                in_process(store, ids, 4), grpc_stream(client, ids, 4), http_stream(http, 4)
            for r in range(args.rounds):
                for name, run in (
                    ("in_process", lambda: in_process(store, ids, args.new_tokens)),
                    ("grpc_stream", lambda: grpc_stream(client, ids, args.new_tokens)),
                    ("http_stream", lambda: http_stream(http, args.new_tokens)),
                ):
                    t, n = run()
                    times[name].append(t)
                    counts[name].append(n)
                print(
                    f"round {r}: "
                    + "  ".join(f"{k} {v[-1] * 1000:.2f} ms/token" for k, v in times.items()),
                    flush=True,
                )
    finally:
        server.stop(timeout_s=30)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "model": loaded.description.name,
        "cache": {"sink": args.sink, "window": args.window},
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "prompt_tokens": len(ids),
        "tokens_per_reply": counts,
        "per_token_s": times,
        "median_per_token_s": med,
        "ratio_grpc_over_in_process": med["grpc_stream"] / med["in_process"],
        "ratio_http_over_in_process": med["http_stream"] / med["in_process"],
        "affinity": sorted(os.sched_getaffinity(0)),
    }
    print(
        f"median per-token decode: in-process {med['in_process'] * 1000:.2f} ms, "
        f"gRPC stream {med['grpc_stream'] * 1000:.2f} ms "
        f"({out['ratio_grpc_over_in_process']:.3f}x), HTTP stream "
        f"{med['http_stream'] * 1000:.2f} ms ({out['ratio_http_over_in_process']:.3f}x); "
        f"target <= 1.05x"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
