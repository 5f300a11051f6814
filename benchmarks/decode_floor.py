"""Plain decoding against the weight-read floor, on this machine.

    OMP_NUM_THREADS=2 python benchmarks/decode_floor.py --out-dir evidence/decode_floor

A one-token step must read every weight once, so it cannot beat ``weight bytes / read
bandwidth``. In one run this script measures the read bandwidth (one pass over a float32
tensor of ``--gib`` GiB in huge pages, as the loaded weights are, ``t.sum()``, best of
``--bandwidth-repeats``), the floor that
implies for the model's weights (each tensor counted once: a tied embedding is read once,
as the lm_head), and plain greedy decoding (``Verifier.append`` of one token, the cache
full at ``--live`` entries so every step evicts) through transformers' forward
(``lean=False``), through the lean step (the default: with the compiled step operations
where they build, ``kakeya_lab/native/step.py``) and through the lean step with PyTorch's
operations (``lean-pytorch-ops``) and with the compiled operations but each layer's
operations one by one rather than one compiled call (``lean-layer-ops``), each on every
full-precision linear kernel (``aten``,
``onednn``, ``split``, ``exact``), interleaved round by round after one warm-up round
(``--steps`` tokens a round, ``--rounds`` rounds, every live size in every round, and a
bandwidth pass after each block of steps, so a changing load falls on all alike; the median
round per token, the best bandwidth pass). On a shared machine the read speed swings by
twice from pass to pass, and the best pass is a moment most steps do not get, so beside the
floor it gives the floor at the median pass and the floor of the moment: each block of
steps against the floor its neighbouring passes imply (the mean of the pass just before and
just after it), the median over the rounds, which says how close a step comes to the
memory it had. As a diagnostic it times the model's own weight tensors read where they lie
(a sum of each in turn, best pass): how much of the gap is reading many separate tensors
rather than one block, and how much is the step itself. Prints each as a ratio to the floor
and whether the target (plain decoding, the fastest kernel, at most ``--target`` times the
floor) is met at every live size, against the floor (the best pass, the verdict) and against
the floor of the moment. The ``exact`` kernel computes the float32 weights' products from
their exact integer forms (a dequantised GGUF's 4- and 8-bit blocks), so it reads fewer bytes
than the weights hold; beside the float32 floor the script gives the floor of the bytes the
fastest lean step reads (those forms' when it is ``exact``) and the ratio to it. Writes
``decode_floor.json`` (with the CPU's model and flags, the machine's load average before and
after) and ``command.txt`` into ``--out-dir``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from kakeya_lab import SinkWindowConfig, Verifier, load_model
from kakeya_lab.backends.torch_lean import LeanForward
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.data import domain_conversations
from kakeya_lab.durable import write_json_atomic
from kakeya_lab.linear import set_linear_kernel
from kakeya_lab.linear_auto import full_precision_kernels
from kakeya_lab.models.memory import huge_page_tensor
from kakeya_lab.native import exact
from kakeya_lab.results import hardware, now_iso

KERNELS = full_precision_kernels()
# Verifier(lean=...); "lean-layer-ops" is the lean step with its layers' operations one by one
# instead of one compiled call each (LeanForward.compiled_layer), "lean-pytorch-ops" with
# PyTorch's small operations instead of the compiled ones (LeanForward(compiled=False)), to
# show what each saves
FORWARDS = {"transformers": False, "lean": None, "lean-layer-ops": None, "lean-pytorch-ops": None}


def read_bandwidth(gib: float, repeats: int) -> tuple[torch.Tensor, list[float]]:
    """A float32 tensor of ``gib`` GiB and the seconds of ``repeats`` passes over it
    (``t.sum()``); its bytes over the best pass are the read bandwidth. The tensor is in huge
    pages, as the loaded model's weights are (``place_weights``): the fastest read this
    machine offers, so the floor is not raised by a slower kind of memory."""
    t = huge_page_tensor(int(gib * (1 << 30)) // 4).fill_(1.0)
    t.sum()  # warm: fill_ touched the pages; this loads the kernel
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    return t, times


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers in its order, each once (a tied weight once). The
    loaded weights are views of one block (``place_weights``), so a tensor is told apart by
    where its bytes start, not by its storage."""
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen.setdefault((tensor.data_ptr(), tensor.nbytes), tensor)
    return list(seen.values())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each once (:func:`weight_tensors`)."""
    return sum(t.nbytes for t in weight_tensors(model))


def exact_bytes(model: torch.nn.Module) -> int:
    """Bytes a one-token step reads on the ``exact`` kernel: each weight tensor once
    (:func:`weight_tensors`), a weight with an exact integer form
    (:mod:`kakeya_lab.native.exact`) at that form's size."""
    total = 0
    for t in weight_tensors(model):
        form = exact.pack(t) if t.dim() == 2 else None
        total += t.nbytes if form is None else sum(part.nbytes for part in form)
    return total


def read_in_place(tensors: list[torch.Tensor]) -> float:
    """Seconds of one pass over ``tensors`` where they lie (``t.sum()`` each, in order)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in tensors:
            t.sum()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--live", default="256,1024", help="live cache entries, comma-separated")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--bandwidth-repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--target", type=float, default=1.3)
    parser.add_argument("--note", default="", help="a line for command.txt (e.g. the load)")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    lives = [int(x) for x in args.live.split(",")]

    started = now_iso()
    load_before = os.getloadavg()
    loaded = load_model(args.model, progress=False)
    model = loaded.model
    wbytes = weight_bytes(model)
    packed_bytes = exact_bytes(model)
    bandwidth_tensor, passes = read_bandwidth(args.gib, args.bandwidth_repeats)
    tensors = weight_tensors(model)
    in_place = [read_in_place(tensors) for _ in range(args.bandwidth_repeats)]
    print(
        f"{loaded.description.name}: {wbytes / 1e6:.1f} MB of weights ({packed_bytes / 1e6:.1f} "
        f"MB in their exact integer forms, what the exact kernel reads); torch threads "
        f"{torch.get_num_threads()}"
    )

    verifiers, next_ids = {}, {}
    for live in lives:
        config = SinkWindowConfig(sink=4, window=live - 4)
        conversations = [c.turns for c in domain_conversations("chitchat", "dev")]
        ctx = ChatTemplate(loaded.tokenizer).replay(itertools.cycle(conversations), live)
        for forward, lean in FORWARDS.items():
            v = Verifier(model, config, lean=lean)
            if forward == "lean-layer-ops":
                one_by_one = LeanForward(model)
                one_by_one.compiled_layers = [None] * len(one_by_one.layers)
                v.backend.lean_forward = one_by_one
            if forward == "lean-pytorch-ops":
                v.backend.lean_forward = LeanForward(model, compiled=False)
            next_ids[live, forward] = int(v.append(ctx).argmax())
            verifiers[live, forward] = v
    names = [f"{fw}/{k}" for fw in FORWARDS for k in KERNELS]
    times: dict[int, dict[str, list[float]]] = {live: {n: [] for n in names} for live in lives}
    # each timed block's floor at that moment: from the bandwidth passes just before and after
    moment_floors: dict[int, dict[str, list[float]]] = {
        live: {n: [] for n in names} for live in lives
    }

    def bandwidth_pass() -> float:
        t0 = time.perf_counter()
        bandwidth_tensor.sum()
        passes.append(time.perf_counter() - t0)
        return passes[-1]

    before = bandwidth_pass()
    for r in range(args.rounds + 1):
        for kernel in KERNELS:  # every live size, forward and kernel in every round
            set_linear_kernel(model, kernel)
            for (live, forward), v in verifiers.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):  # greedy plain decoding, one token a step
                    next_ids[live, forward] = int(v.append([next_ids[live, forward]]).argmax())
                took = (time.perf_counter() - t0) / args.steps
                after = bandwidth_pass()
                if r:  # round 0 warms up
                    times[live][f"{forward}/{kernel}"].append(took)
                    moment_floors[live][f"{forward}/{kernel}"].append(
                        wbytes * (before + after) / 2 / bandwidth_tensor.nbytes
                    )
                before = after
        in_place.append(read_in_place(tensors))
    set_linear_kernel(model, "aten")
    bandwidth = bandwidth_tensor.nbytes / min(passes)
    floor_s = wbytes / bandwidth
    # beside the floor (the best pass: the bound), the floor at the median pass: on a shared
    # machine whose read speed swings, how close a step comes to what memory usually gives
    median_floor_s = wbytes * statistics.median(passes) / bandwidth_tensor.nbytes
    in_place_s = min(in_place)
    print(
        f"read bandwidth {bandwidth / 1e9:.2f} GB/s (best of {len(passes)} passes over "
        f"{args.gib:g} GiB, {args.bandwidth_repeats} first, then one after each block of steps; median "
        f"{bandwidth_tensor.nbytes / statistics.median(passes) / 1e9:.2f}); floor "
        f"{floor_s * 1e3:.2f} ms/token (at the median pass {median_floor_s * 1e3:.2f})"
    )
    print(
        f"the weights read where they lie (a sum of each tensor in turn): best "
        f"{in_place_s * 1e3:.2f} ms ({in_place_s / floor_s:.2f}× floor), median "
        f"{statistics.median(in_place) * 1e3:.2f} ms"
    )
    results: dict[str, dict] = {}
    for live in lives:
        lean_steps = verifiers[live, "lean"].backend.lean_steps
        assert verifiers[live, "lean"].cache_len == live and lean_steps > 0
        assert verifiers[live, "lean-pytorch-ops"].backend.lean_forward.native is None
        assert verifiers[live, "lean-layer-ops"].backend.lean_forward.compiled_layer_calls == 0
        assert verifiers[live, "transformers"].backend.lean_steps == 0
        median = {name: statistics.median(ts) for name, ts in times[live].items()}
        best = {fw: min(KERNELS, key=lambda k, fw=fw: median[f"{fw}/{k}"]) for fw in FORWARDS}
        # each block against the floor of its own moment, the median over the rounds
        moment = {
            name: statistics.median(
                t / f for t, f in zip(times[live][name], moment_floors[live][name], strict=True)
            )
            for name in names
        }
        # the floor of the bytes the fastest lean step reads (exact: the packed forms)
        read_floor_s = (packed_bytes if best["lean"] == "exact" else wbytes) / bandwidth
        results[str(live)] = {
            "read_floor_ms": read_floor_s * 1e3,
            "fastest_ratio_to_read_floor": median[f"lean/{best['lean']}"] / read_floor_s,
            "median_s": median,
            "timings_s": times[live],
            "moment_floor_s": moment_floors[live],
            "ratio_to_floor": {name: s / floor_s for name, s in median.items()},
            "ratio_to_moment_floor": moment,
            "fastest_kernel": best,
            "fastest_s": {fw: median[f"{fw}/{best[fw]}"] for fw in FORWARDS},
            "fastest_ratio": {fw: median[f"{fw}/{best[fw]}"] / floor_s for fw in FORWARDS},
            "fastest_ratio_to_median_floor": {
                fw: median[f"{fw}/{best[fw]}"] / median_floor_s for fw in FORWARDS
            },
            "fastest_ratio_to_moment_floor": {fw: moment[f"{fw}/{best[fw]}"] for fw in FORWARDS},
            "fastest_ratio_to_in_place": {
                fw: median[f"{fw}/{best[fw]}"] / in_place_s for fw in FORWARDS
            },
            "lean_speedup": median[f"transformers/{best['transformers']}"]
            / median[f"lean/{best['lean']}"],
            "lean_steps": lean_steps,
            "compiled_step_ops": verifiers[live, "lean"].backend.lean_forward.native is not None,
            "compiled_step_ops_speedup": median[f"lean-pytorch-ops/{best['lean-pytorch-ops']}"]
            / median[f"lean/{best['lean']}"],
            "compiled_layer_calls": verifiers[
                live, "lean"
            ].backend.lean_forward.compiled_layer_calls,
            "compiled_layer_speedup": median[f"lean-layer-ops/{best['lean-layer-ops']}"]
            / median[f"lean/{best['lean']}"],
        }
        print(f"\n{live} live entries (ms/token, × floor, × the floor of the moment):")
        for name, s in median.items():
            print(f"  {name:22s} {s * 1e3:7.2f}  {s / floor_s:5.2f}×  {moment[name]:5.2f}×")
        for fw in FORWARDS:
            row = results[str(live)]
            print(
                f"  fastest {fw}: {best[fw]} {row['fastest_s'][fw] * 1e3:.2f} ms "
                f"({row['fastest_ratio'][fw]:.2f}× floor, "
                f"{row['fastest_ratio_to_median_floor'][fw]:.2f}× the median pass's, "
                f"{row['fastest_ratio_to_moment_floor'][fw]:.2f}× the moment's, "
                f"{row['fastest_ratio_to_in_place'][fw]:.2f}× the weights read in place)"
            )
        print(
            f"  fastest lean against the floor of the bytes it reads ({read_floor_s * 1e3:.2f} "
            f"ms): {row['fastest_ratio_to_read_floor']:.2f}×"
        )
        print(
            f"  the lean step's gain from its compiled layers "
            f"{row['compiled_layer_speedup']:.2f}× ({row['compiled_layer_calls']} calls), "
            f"from its compiled operations {row['compiled_step_ops_speedup']:.2f}×"
        )
    met = {live: row["fastest_ratio"]["lean"] <= args.target for live, row in results.items()}
    met_moment = {
        live: row["fastest_ratio_to_moment_floor"]["lean"] <= args.target
        for live, row in results.items()
    }
    met_read = {
        live: row["fastest_ratio_to_read_floor"] <= args.target for live, row in results.items()
    }
    print()
    for label, key, ok in (
        ("the floor (the best pass)", "fastest_ratio", met),
        ("the floor of the moment", "fastest_ratio_to_moment_floor", met_moment),
        ("the floor of the bytes it reads", "fastest_ratio_to_read_floor", met_read),
    ):
        ratios = {
            live: results[live][key] if key == "fastest_ratio_to_read_floor" else
            results[live][key]["lean"]
            for live in ok
        }  # fmt: skip
        print(
            f"target: plain decoding <= {args.target}× {label}: "
            + ("met " if all(ok.values()) else "not met ")
            + ", ".join(f"{live}: {ratio:.2f}×" for live, ratio in ratios.items())
        )
    load_after = os.getloadavg()
    hw = hardware()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        args.out_dir / "decode_floor.json",
        {
            "model": loaded.description.name,
            "weight_sha256": loaded.description.weight_sha256,
            "weight_bytes": wbytes,
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_gb_per_s": bandwidth / 1e9,
            "bandwidth_pass_s": passes,
            "floor_s": floor_s,
            "floor_ms": floor_s * 1e3,
            "median_pass_floor_ms": median_floor_s * 1e3,
            "in_place_pass_s": in_place,
            "in_place_ms": in_place_s * 1e3,
            "steps_per_round": args.steps,
            "rounds": args.rounds,
            "target_ratio": args.target,
            "target_met": {live: bool(ok) for live, ok in met.items()},
            "target_met_moment_floor": {live: bool(ok) for live, ok in met_moment.items()},
            "target_met_read_floor": {live: bool(ok) for live, ok in met_read.items()},
            "exact_bytes": packed_bytes,
            "live": results,
            "hardware": hw,
            "torch": torch.__version__,
            "load_average_before": list(load_before),
            "load_average_after": list(load_after),
            "started": started,
            "finished": now_iso(),
        },
    )
    command = "OMP_NUM_THREADS={} python benchmarks/decode_floor.py {}".format(
        os.environ.get("OMP_NUM_THREADS", ""), shlex.join(sys.argv[1:] if argv is None else argv)
    )
    lines = [
        "# Plain decoding against the weight-read floor (benchmarks/decode_floor.py), one run:",
        f"# {hw['cpu']}, {hw['cpu_count']} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after.",
    ]
    if args.note:
        lines.append(f"# {args.note}")
    (args.out_dir / "command.txt").write_text("\n".join([*lines, command]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
