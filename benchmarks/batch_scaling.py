"""Benchmark: 1, 2, 4, ... concurrent sessions, each step in its own forward or batched.

In process, each level runs that many sessions in threads over one ``SessionStore``
(``batch=False``, then ``batch=True``): every session appends its prompt and greedily
decodes ``--new-tokens`` tokens (no EOS stop). Through the server, the same levels run
against a ``kakeya-lab serve`` with ``--no-batch`` and with ``--batch``: over gRPC with
:func:`kakeya_lab.serve.load.run_load` (one turn per session; its per-turn latency) and
with the ``openai`` client streaming a chat completion per session (time to first chunk,
gaps between chunks). Every level reports the aggregate tokens/s, the per-token latency
p50/p95 over every session's token gaps, and the time to first token (p50), each as a
ratio to the solo run of the same path in the same run (the fastest of one session
without and with batching, each measured first and again after the other levels: the
fastest single session measured), and the script prints whether the targets of issue 27
are met: at 8 sessions, batched aggregate >= 4x the solo rate and p95 per-token latency
<= 2.5x the solo p95; at 16, an aggregate no lower than at 8.

    OMP_NUM_THREADS=1 python benchmarks/batch_scaling.py --levels 1 2 4 8 16 \
        --out evidence/batch_scaling/batch_scaling.json

``--no-server`` measures in process only. ``OMP_NUM_THREADS`` sets the torch threads of
this process and of the servers it starts; ``--linear`` their kernel (default ``auto``, as
the server's; ``split`` needs two threads). The JSON records the CPU, the load average before and after, and every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.thread_pool import release_thread_pool
from kakeya_lab.cli_args import VERIFIER_KERNELS
from kakeya_lab.models import DEFAULT_MODEL, load_model
from kakeya_lab.results import hardware
from kakeya_lab.session import SessionStore, Token

TOPICS = [
    "the tides",
    "a lighthouse",
    "bread baking",
    "mountain trails",
    "old maps",
    "winter birds",
    "river boats",
    "clock making",
    "desert stars",
    "city gardens",
    "paper kites",
    "harbour fog",
    "glass blowing",
    "night trains",
    "beekeeping",
    "stone bridges",
]


AGAIN = "1 again"  # the level of one session, measured again after the others


def prompt_text(i: int) -> str:
    return f"Tell me a short story about {TOPICS[i % len(TOPICS)]}."


def cpu_flags() -> list[str]:
    """The CPU's vector and matrix extensions (what decides which kernel wins)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))
    except OSError:
        pass
    return []


def timing_summary(
    starts: list[float], firsts: list[float | None], stamps: list[list[float]], tokens: int
) -> dict[str, Any]:
    """Aggregate tokens/s over the whole level, per-token gaps p50/p95 pooled over sessions
    (and the worst session's p95), time to first token p50/max."""
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    ends = [s[-1] for s in stamps if s]
    wall = max(ends) - min(starts) if ends else float("nan")
    ttft = [f - s for f, s in zip(firsts, starts) if f is not None]
    worst = [float(np.percentile(np.diff(s), 95)) for s in stamps if len(s) > 2]
    return {
        "sessions": len(starts),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "per_token_p50_s": float(np.percentile(gaps, 50)) if gaps else float("nan"),
        "per_token_p95_s": float(np.percentile(gaps, 95)) if gaps else float("nan"),
        "worst_session_p95_s": max(worst) if worst else float("nan"),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else float("nan"),
        "ttft_max_s": max(ttft) if ttft else float("nan"),
    }


def in_threads(n: int, one: Callable[[int], tuple[float, float | None, list[float], int]]) -> dict:
    """Run ``one(i)`` for ``i < n`` at once (released together); ``one`` returns (start,
    first token time, token times, tokens)."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = one(i)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    release_thread_pool()  # the sessions' threads compute (kakeya_lab/backends/thread_pool.py)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return timing_summary(
        [r[0] for r in results], [r[1] for r in results], [r[2] for r in results],
        sum(r[3] for r in results),
    )  # fmt: skip


def in_process_level(loaded, config: SinkWindowConfig, n: int, tokens: int, batch: bool) -> dict:
    store = SessionStore(loaded.model, config, capacity=max(n, 1), eos_token_ids=[], batch=batch)
    store.warm_up()  # the kernels' one-time packing outside the timing, as a server does
    tok = loaded.tokenizer
    prompts = [  # what the HTTP endpoint renders for the same message
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": prompt_text(i)}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )["input_ids"]
        for i in range(n)
    ]

    def one(i: int) -> tuple[float, float | None, list[float], int]:
        sid = store.create()
        t0 = time.perf_counter()
        store.append(sid, prompts[i])
        stamps = [time.perf_counter() for e in store.generate(sid, tokens) if isinstance(e, Token)]
        store.close(sid)
        return t0, stamps[0] if stamps else None, stamps, len(stamps)

    # the model's batched forward counts every level's forwards: this level's are the difference
    f = store.batcher.forward if store.batcher is not None else None
    rows0, forwards0 = (f.rows, f.forwards) if f is not None else (0, 0)
    summary = in_threads(n, one)
    if f is not None and store.batcher is not None:
        forwards = f.forwards - forwards0
        summary["mean_rows_per_forward"] = (f.rows - rows0) / forwards if forwards else None
        # the typical step's rows: the mean also counts the prompts' prefill rows
        batches = store.batcher.batches  # this store's batches (its most recent 1,000)
        summary["median_rows_per_forward"] = float(np.median(batches)) if batches else None
    return summary


def grpc_level(grpc_target: str, n: int, tokens: int) -> dict:
    from kakeya_lab.serve.load import latency_summary, load_conversations, run_load

    result = run_load(grpc_target, load_conversations(n, 1, seed=n), tokens)
    s = latency_summary(result)
    per_token = [t / max(len(r), 1) for ts, rs in zip(result.turn_s, result.replies)
                 for t, r in zip(ts, rs)]  # fmt: skip
    return {
        "sessions": n,
        "tokens": s["generated_tokens"],
        "wall_s": s["wall_s"],
        "tokens_per_s": s["tokens_per_s"],
        "turn_p50_s": s["turn_p50_s"],
        "turn_p95_s": s["turn_p95_s"],
        "per_token_p50_s": float(np.percentile(per_token, 50)),
        "per_token_p95_s": float(np.percentile(per_token, 95)),
    }


def openai_level(http_base: str, n: int, tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{http_base}/v1", api_key="x", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(i: int) -> tuple[float, float | None, list[float], int]:
        t0 = time.perf_counter()
        stamps: list[float] = []
        used = 0
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt_text(i)}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"reuse": False},  # a session of its own, closed at the end
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return t0, stamps[0] if stamps else None, stamps, used or len(stamps)

    return in_threads(n, one)


def ratios(levels: dict[str, dict], solo: dict) -> None:
    """Add each level's ratios to ``solo`` (the fastest single session, same path)."""
    for row in levels.values():
        row["aggregate_vs_solo"] = row["tokens_per_s"] / solo["tokens_per_s"]
        for key in ("per_token_p50_s", "per_token_p95_s", "ttft_p50_s"):
            if key in row and key in solo:
                row[key.replace("_s", "") + "_vs_solo"] = row[key] / solo[key]


def targets(batched: dict[str, dict], solo: dict) -> dict[str, bool | None]:
    """Issue 27's targets on one path's batched levels (None: that level was not run)."""
    eight, sixteen = batched.get("8"), batched.get("16")
    return {
        "8: aggregate >= 4x solo": None
        if eight is None
        else eight["tokens_per_s"] >= 4 * solo["tokens_per_s"],
        "8: p95 per-token <= 2.5x solo": None
        if eight is None
        else eight["per_token_p95_s"] <= 2.5 * solo["per_token_p95_s"],
        "16: aggregate >= 8's": None
        if eight is None or sixteen is None
        else sixteen["tokens_per_s"] >= eight["tokens_per_s"],
    }


def report(name: str, runs: dict[str, dict[str, dict]]) -> dict:
    """Ratios to the solo run, the targets, and a printed table for one path. The solo
    run is the fastest of one session without and with batching, each measured first and
    again last (:data:`AGAIN`: a machine whose speed drifts during the script would
    otherwise flatter or hurt every ratio): every ratio is against the fastest single
    session measured."""
    solo_mode, solo_key = max(
        ((mode, key) for mode in runs for key in ("1", AGAIN) if key in runs[mode]),
        key=lambda at: runs[at[0]][at[1]]["tokens_per_s"],
    )
    solo = runs[solo_mode][solo_key]
    for levels in runs.values():
        ratios(levels, solo)
    met = targets(runs["batched"], solo)
    print(f"\n{name}: solo ({solo_mode}, {solo_key}) {solo['tokens_per_s']:.2f} tokens/s, "
          f"p95 per token {solo['per_token_p95_s'] * 1e3:.0f} ms")  # fmt: skip
    # rows: the median rows of a batched forward
    print(f"{'mode':8} {'n':>7} {'tok/s':>8} {'x solo':>7} {'p50 ms':>7} {'p95 ms':>7} "
          f"{'p95 x':>6} {'ttft ms':>8} {'rows':>5}")  # fmt: skip
    for mode, levels in runs.items():
        for n, r in levels.items():
            ttft = r.get("ttft_p50_s")
            rows = r.get("median_rows_per_forward")
            print(
                f"{mode:8} {n:>7} {r['tokens_per_s']:8.2f} {r['aggregate_vs_solo']:7.2f} "
                f"{r['per_token_p50_s'] * 1e3:7.0f} {r['per_token_p95_s'] * 1e3:7.0f} "
                f"{r['per_token_p95_vs_solo']:6.2f} "
                f"{'' if ttft is None else f'{ttft * 1e3:8.0f}':>8} "
                f"{'' if rows is None else f'{rows:5.1f}':>5}"
            )
    for target, ok in met.items():
        print(f"  target {target}: {'not run' if ok is None else 'met' if ok else 'NOT met'}")
    return {"levels": runs, "solo": f"{solo_mode}/{solo_key}", "targets": met}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per session")
    parser.add_argument("--no-server", action="store_true", help="in process only")
    parser.add_argument(
        "--linear",
        default="auto",
        choices=list(VERIFIER_KERNELS),
        help="the linear layers' kernel, in process and in the servers (default auto, the "
        "server's own default: the fastest measured on this machine for each row count)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    if 1 not in args.levels:
        parser.error("--levels must include 1 (the solo run every ratio is taken against)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    levels = sorted(set(args.levels))
    config = SinkWindowConfig(sink=args.sink, window=args.window)
    record: dict[str, Any] = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "hardware": {**hardware(), "cpu_flags": cpu_flags()},
        "load_average_before": os.getloadavg(),
    }
    loaded = load_model(args.model, dtype=torch.float32, linear=args.linear, progress=False)
    order = [str(n) for n in levels] + [AGAIN]  # one session first and again last
    runs: dict[str, dict[str, dict]] = {"solo": {}, "batched": {}}
    for mode in runs:
        for key in order:
            runs[mode][key] = in_process_level(
                loaded, config, int(key.split()[0]), args.new_tokens, batch=mode == "batched"
            )
    record["in_process"] = report("in process (SessionStore)", runs)
    if not args.no_server:
        from kakeya_lab.serve.process import start_server

        served: dict[str, dict[str, dict[str, dict]]] = {
            "grpc": {"solo": {}, "batched": {}},
            "openai": {"solo": {}, "batched": {}},
        }
        for mode in ("solo", "batched"):
            extra = ["--sink", str(args.sink), "--window", str(args.window)]
            extra += ["--capacity", str(max(levels)), "--admission", "evict_lru"]
            extra += ["--linear", args.linear]
            extra += ["--batch"] if mode == "batched" else ["--no-batch"]
            server = start_server(
                *extra, model=args.model, timeout_s=300, threads=torch.get_num_threads()
            )
            try:
                for key in order:
                    n = int(key.split()[0])
                    served["grpc"][mode][key] = grpc_level(server.grpc_target, n, args.new_tokens)
                    served["openai"][mode][key] = openai_level(server.http_base, n, args.new_tokens)
            finally:
                server.stop()
        record["grpc"] = report("gRPC (run_load)", served["grpc"])
        record["openai"] = report("openai client (HTTP streaming)", served["openai"])
    record["load_average_after"] = os.getloadavg()
    print(f"\nCPU: {record['hardware']['cpu']} ({record['hardware']['cpu_count']} logical); "
          f"load average before {record['load_average_before'][0]:.1f}, after "
          f"{record['load_average_after'][0]:.1f}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
