"""Prefill and decode of the default model on MLX with each BLAS, beside torch.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/mlx_blas.py --out FILE

Each configuration runs in its own interpreter (the BLAS is chosen before ``mlx`` is
imported, see ``kakeya_lab/blas.py``): MLX with the system OpenBLAS, MLX with the wheel's
bundled reference BLAS (``KAKEYA_MLX_BLAS=bundled``), and torch. Each times a
``--prefill``-token append into an empty sink-window cache and then ``--decode`` one-token
appends, ``--repeats`` times, and reports medians. Prints the ratios against torch and
against the bundled BLAS; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kakeya_lab.durable import write_json_atomic

_CHILD = r"""
import json, statistics, sys, time
import kakeya_lab
from kakeya_lab import SinkWindowConfig, Verifier, load_model
from kakeya_lab.blas import mlx_blas
backend, model_name, prefill, decode, repeats = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
loaded = load_model(model_name, backend=backend, progress=False)
ids = [100 + (7 * i) % 30000 for i in range(prefill + decode)]
prefills, decodes = [], []
for _ in range(repeats):
    verifier = Verifier(loaded.model, SinkWindowConfig(sink=4, window=1020))
    t0 = time.perf_counter()
    verifier.append(ids[:prefill])
    prefills.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for token in ids[prefill:]:
        verifier.append([token])
    decodes.append((time.perf_counter() - t0) / decode)
print(json.dumps({
    "backend": backend,
    "blas": mlx_blas() if backend == "mlx" else "torch",
    "prefill_s": statistics.median(prefills),
    "decode_s_per_token": statistics.median(decodes),
    "prefill_all_s": prefills,
    "decode_all_s_per_token": decodes,
}))
"""


def _measure(backend: str, args: argparse.Namespace, **env: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            backend,
            args.model,
            str(args.prefill),
            str(args.decode),
            str(args.repeats),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = {
        "mlx_system_blas": _measure("mlx", args),
        "mlx_bundled_blas": _measure("mlx", args, KAKEYA_MLX_BLAS="bundled"),
        "torch": _measure("torch", args),
    }
    torch_run, bundled = runs["torch"], runs["mlx_bundled_blas"]
    ratios = {
        name: {
            "prefill_over_torch": run["prefill_s"] / torch_run["prefill_s"],
            "decode_over_torch": run["decode_s_per_token"] / torch_run["decode_s_per_token"],
            "prefill_over_bundled": run["prefill_s"] / bundled["prefill_s"],
            "decode_over_bundled": run["decode_s_per_token"] / bundled["decode_s_per_token"],
        }
        for name, run in runs.items()
    }
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs, "ratios": ratios}
    write_json_atomic(args.out, result)
    for name, run in runs.items():
        r = ratios[name]
        print(
            f"{name:18s} blas {run['blas']:20s} prefill {run['prefill_s']:.3f} s "
            f"({r['prefill_over_torch']:.2f}x torch)  decode {1000 * run['decode_s_per_token']:.1f} ms "
            f"({r['decode_over_torch']:.2f}x torch)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
