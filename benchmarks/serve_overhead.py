"""Benchmark: server overhead per generated token against in-process decoding.

One run, default model, one cache configuration: a ``kakeya-lab serve`` subprocess and an
in-process :class:`~kakeya_lab.session.SessionStore` over the same weights decode the same
prompt greedily, interleaved round by round (in-process, gRPC streaming, HTTP streaming),
so all three share machine conditions. Per-token decode latency is measured where a client
sees tokens arrive: ``(t_last - t_first) / (n - 1)`` over the token events of one reply
(the in-process store's iterator, the gRPC client's stream, the SSE chunks of
``/v1/chat/completions``); prefill and the first token are excluded. Prints medians over
the rounds and the ratios served / in-process (target <= 1.05), both as the ratio of the
medians and as the median of each round's own ratio (a round's three replies run back to
back, so the per-round ratio is the one least moved by load that changes between rounds).
Beside wall time it records CPU time per token over the same span (this process's, plus the
server process's for the served arms): on a core shared with other work, wall time also
counts the time slices other processes take at every hand-off between client and server,
CPU time counts only the work the serving path itself does.

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
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import torch

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.models import DEFAULT_MODEL, load_model
from kakeya_lab.serve.client import SessionClient
from kakeya_lab.serve.process import start_server
from kakeya_lab.session import SessionStore, Token

PROMPT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "out loud as his father had taught him. At the top he"
)


Clock = Callable[[], tuple[float, float]]  # (wall seconds, CPU seconds) now


def per_token(stamps: list[tuple[float, float]]) -> tuple[float, float]:
    """Wall and CPU seconds per token between the first and the last token's arrival."""
    if len(stamps) < 2:
        raise RuntimeError(f"only {len(stamps)} token(s) arrived: cannot time decoding")
    n = len(stamps) - 1
    return (stamps[-1][0] - stamps[0][0]) / n, (stamps[-1][1] - stamps[0][1]) / n


def in_process(store: SessionStore, ids: list[int], n: int) -> tuple[float, float, int]:
    sid = store.create()
    try:
        store.append(sid, ids)
        stamps = [
            (time.perf_counter(), time.process_time())
            for e in store.generate(sid, n)
            if isinstance(e, Token)
        ]
    finally:
        store.close(sid)
    return *per_token(stamps), len(stamps)


def grpc_stream(
    client: SessionClient, ids: list[int], n: int, clock: Clock
) -> tuple[float, float, int]:
    sid = client.create()
    try:
        client.append_ids(sid, ids)
        stamps = [clock() for e in client.stream(sid, n) if e.WhichOneof("event") == "token"]
    finally:
        client.close_session(sid)
    return *per_token(stamps), len(stamps)


def http_stream(http: httpx.Client, n: int, clock: Clock) -> tuple[float, float, int]:
    """SSE chunks of a stateless request: one content chunk per token (prose; a token that
    ends inside a UTF-8 sequence would merge into the next chunk, making this an upper
    bound)."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": n, "stream": True,
            "reuse": False}  # fmt: skip
    stamps: list[tuple[float, float]] = []
    tokens = 0
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"][0]["delta"].get("content"):
                stamps.append(clock())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return *per_token(stamps), tokens


def served_clock(pid: int) -> Clock:
    """Wall time, and the CPU time of this process (the client) plus the server's."""
    server = psutil.Process(pid)

    def clock() -> tuple[float, float]:
        cpu = server.cpu_times()
        return time.perf_counter(), time.process_time() + cpu.user + cpu.system

    return clock


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
    clock = served_clock(server.proc.pid)
    times: dict[str, list[float]] = {"in_process": [], "grpc_stream": [], "http_stream": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    counts: dict[str, list[int]] = {k: [] for k in times}
    try:
        with (
            SessionClient(grpc_target, timeout_s=600) as client,
            httpx.Client(base_url=http_base, timeout=600) as http,
        ):
            for _ in (0, 1):  # warm-up, not timed
                in_process(store, ids, 4)
                grpc_stream(client, ids, 4, clock), http_stream(http, 4, clock)
            for r in range(args.rounds):
                for name, run in (
                    ("in_process", lambda: in_process(store, ids, args.new_tokens)),
                    ("grpc_stream", lambda: grpc_stream(client, ids, args.new_tokens, clock)),
                    ("http_stream", lambda: http_stream(http, args.new_tokens, clock)),
                ):
                    t, c, n = run()
                    times[name].append(t)
                    cpu[name].append(c)
                    counts[name].append(n)
                print(
                    f"round {r}: "
                    + "  ".join(f"{k} {v[-1] * 1000:.2f} ms/token" for k, v in times.items()),
                    flush=True,
                )
    finally:
        server.stop(timeout_s=30)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
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
        "median_round_ratio_grpc_over_in_process": statistics.median(
            g / i for g, i in zip(times["grpc_stream"], times["in_process"])
        ),
        "median_round_ratio_http_over_in_process": statistics.median(
            h / i for h, i in zip(times["http_stream"], times["in_process"])
        ),
        "cpu_per_token_s": cpu,
        "median_cpu_per_token_s": med_cpu,
        "cpu_ratio_grpc_over_in_process": med_cpu["grpc_stream"] / med_cpu["in_process"],
        "cpu_ratio_http_over_in_process": med_cpu["http_stream"] / med_cpu["in_process"],
        "affinity": sorted(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
    }
    print(
        f"median per-token decode: in-process {med['in_process'] * 1000:.2f} ms, "
        f"gRPC stream {med['grpc_stream'] * 1000:.2f} ms "
        f"({out['ratio_grpc_over_in_process']:.3f}x), HTTP stream "
        f"{med['http_stream'] * 1000:.2f} ms ({out['ratio_http_over_in_process']:.3f}x); "
        f"target <= 1.05x; median of per-round ratios: gRPC "
        f"{out['median_round_ratio_grpc_over_in_process']:.3f}x, HTTP "
        f"{out['median_round_ratio_http_over_in_process']:.3f}x; CPU per token (client + "
        f"server): in-process {med_cpu['in_process'] * 1000:.2f} ms, gRPC "
        f"{out['cpu_ratio_grpc_over_in_process']:.3f}x, HTTP "
        f"{out['cpu_ratio_http_over_in_process']:.3f}x"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
