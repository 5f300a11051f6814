"""``linear="auto"``: the fastest full-precision kernel of this machine, per row count.

Which CPU kernel multiplies a few rows fastest depends on the CPU (and its load): on one machine
PyTorch's default (``aten``) wins one-token steps and oneDNN blocks, on another oneDNN wins
both. :func:`auto_choice` times every full-precision kernel (``aten``, ``split``, ``exact``
where the compiled kernels build and, when this PyTorch has it, ``onednn``) over all of a
model's linear layers, for 1 to :data:`~kakeya_lab.linear.FEW_ROWS` rows (one-token steps and
verification blocks) and for a prefill chunk of :data:`PREFILL_ROWS` rows (what more rows run;
among the kernels that keep no state per row count, :data:`PER_SHAPE_STATE`), interleaved, best
of :data:`REPEATS`; about ten seconds for a 135M model. The choice is cached on disk as JSON
under the model store (``$KAKEYA_LAB_HOME/kernels/``, or ``$KAKEYA_LAB_KERNELS``), one file per
key: the model's identity (its weights' sha256 when loaded from the store), dtype, the CPU's
model name and flags, the torch version and its thread count, and the kernels' revision. A
second call with the same key reads the file (no measurement), so the choice is deterministic
given the file; a file that cannot be read or does not fit is measured again and rewritten.
:class:`~kakeya_lab.linear.AutoLinear` layers then dispatch each call by its row count.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kakeya_lab.linear import (
    FEW_ROWS,
    FULL_PRECISION,
    FULL_PRECISION_PRODUCTS,
    KERNEL_REVISION,
    set_linear_kernel,
)
from kakeya_lab.native import exact
from kakeya_lab.native.build import compiled
from kakeya_lab.results import cpu_identity

PREFILL_ROWS = 64  # the row count timed for "more than FEW_ROWS rows"
# Kernels that keep state for every row count they meet: oneDNN caches a primitive per shape
# (measured: 58 MB of heap for 100 new row counts of one 1536 x 576 weight, up to its cache's
# 1,024 entries). One-token steps and blocks meet FEW_ROWS row counts; prefills meet a new
# one with every prompt length, which in a server is a climb of hundreds of MB. So they are
# not chosen for more than FEW_ROWS rows (where the kernels measured within a few percent).
PER_SHAPE_STATE = ("onednn",)
REPEATS = 3  # passes over the layers per kernel and row count (the best is kept)
measurements = 0  # choices measured in this process (how a test sees a cache hit)


@dataclass(frozen=True)
class AutoChoice:
    """The kernel for each row count: ``few[r - 1]`` for ``r`` rows up to
    :data:`~kakeya_lab.linear.FEW_ROWS`, ``many`` beyond; ``ms[kernel][label]`` the best
    time of one pass over the model's linear layers (labels ``"1"``..``"8"``, ``"prefill"``);
    ``key`` the cache key it was measured under; ``cached`` whether it was read from disk."""

    few: tuple[str, ...]
    many: str
    ms: dict[str, dict[str, float]]
    key: dict[str, Any]
    cached: bool = False

    def kernel_for(self, rows: int) -> str:
        return self.few[rows - 1] if 1 <= rows <= len(self.few) else self.many

    def describe(self) -> str:
        """One line: which kernel won which row count, with its ms per pass."""
        parts = []
        for label, kernel in [(str(r), k) for r, k in enumerate(self.few, 1)] + [
            ("prefill", self.many)
        ]:
            parts.append(f"{label}: {kernel} {self.ms[kernel][label]:.1f} ms")
        return (
            "linear=auto (" + ("cached" if self.cached else "measured") + "): " + ", ".join(parts)
        )

    def summary(self) -> str:
        """Which kernel runs which row counts, e.g. ``exact for 1-16 rows, aten beyond``."""
        runs: list[tuple[str, int, int]] = []
        for rows, kernel in enumerate(self.few, 1):
            if runs and runs[-1][0] == kernel:
                runs[-1] = (kernel, runs[-1][1], rows)
            else:
                runs.append((kernel, rows, rows))
        parts = [
            f"{k} for {a} row{'s' if a > 1 else ''}" if a == b else f"{k} for {a}-{b} rows"
            for k, a, b in runs
        ]
        return ", ".join(parts) + f", {self.many} beyond"

    def table(self) -> tuple[list[str], list[list[str]]]:
        """``(header, rows)``: per row count (``1``..``16``, ``prefill``) each kernel's ms per
        pass over the layers, the chosen one marked ``*``."""
        kernels = list(self.ms)
        rows = []
        for label in _labels():
            chosen = self.many if label == "prefill" else self.few[int(label) - 1]
            rows.append(
                [label]
                + [f"{self.ms[k][label]:.1f}" + (" *" if k == chosen else "") for k in kernels]
            )
        return ["rows", *(f"{k} ms" for k in kernels)], rows

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("cached")
        return data


def full_precision_kernels() -> tuple[str, ...]:
    """The full-precision kernels this PyTorch build can run here, each once: ``onednn``
    needs oneDNN, ``split`` on one thread is ``aten``'s own product, and ``exact`` without
    the compiled kernels is ``split``'s."""
    return tuple(
        k
        for k in FULL_PRECISION
        if (k != "onednn" or torch.backends.mkldnn.is_available())
        and (k != "split" or torch.get_num_threads() > 1)
        and (k != "exact" or compiled() is not None)
    )


def choice_key(model: nn.Module, identity: str | None = None) -> dict[str, Any]:
    """What a cached choice is valid for (module docstring)."""
    if identity is None:  # not from the store: the name and every linear layer's shape
        shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)]
        name = getattr(getattr(model, "config", None), "name_or_path", "") or type(model).__name__
        identity = f"{name}:" + hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]
    weight = next(model.parameters())
    return {
        "model": identity,
        "dtype": str(weight.dtype).removeprefix("torch."),
        **cpu_identity(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": list(full_precision_kernels()),
        "kernel_revision": KERNEL_REVISION,
    }


def default_cache_dir() -> Path:
    """Where choices are cached: ``$KAKEYA_LAB_KERNELS`` if set and non-empty, else
    ``<store>/kernels``. Read on every call."""
    env = os.environ.get("KAKEYA_LAB_KERNELS")
    if env:
        return Path(env).expanduser()
    from kakeya_lab.models.store import store_home

    return store_home() / "kernels"


def cache_file(key: dict[str, Any], cache_dir: Path | None = None) -> Path:
    """The file a choice for ``key`` (:func:`choice_key`, or an :class:`AutoChoice`'s
    ``key``) is cached in: one per key under ``cache_dir`` (:func:`default_cache_dir`)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return (cache_dir or default_cache_dir()) / f"linear-{digest}.json"


def _read(path: Path, key: dict[str, Any]) -> AutoChoice | None:
    """The choice cached in ``path`` for ``key``; None if missing, unreadable or not fitting."""
    try:
        data = json.loads(path.read_text())
        kernels = set(key["kernels"])
        few, many, ms = tuple(data["few"]), data["many"], data["ms"]
        if data["key"] != key or len(few) != FEW_ROWS or not set(few) | {many} <= kernels:
            return None
        if not all(isinstance(ms[k][label], float) for k in kernels for label in _labels()):
            return None
        return AutoChoice(few, many, ms, key, cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _labels() -> list[str]:
    return [str(r) for r in range(1, FEW_ROWS + 1)] + ["prefill"]


def _one_pass(layers: list[nn.Linear], inputs: dict[int, torch.Tensor], kernel: str) -> float:
    """Milliseconds of one product per layer on ``kernel``."""
    t0 = time.perf_counter()
    for layer in layers:
        x = inputs[layer.in_features]
        FULL_PRECISION_PRODUCTS[kernel](layer.weight, layer.bias, x)
    return (time.perf_counter() - t0) * 1000


@torch.inference_mode()
def _measure(model: nn.Module, key: dict[str, Any]) -> AutoChoice:
    """Time every kernel over ``model``'s linear layers for each row count (interleaved)."""
    global measurements
    if sys.stderr.isatty():  # a terminal waits: say why
        print(
            "kakeya-lab: timing the linear kernels for this model on this CPU "
            "(once, then cached; about ten seconds for a 135M model)",
            file=sys.stderr,
        )
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weight = next(model.parameters())
    kernels = full_precision_kernels()
    if "split" in kernels or "exact" in kernels:
        compiled()  # built or loaded before the timing, not within split's first pass
    ms: dict[str, dict[str, float]] = {k: {} for k in kernels}
    packed_before = {id(layer.weight) for layer in layers if exact.is_packed(layer.weight)}
    for label in _labels():
        rows = PREFILL_ROWS if label == "prefill" else int(label)
        inputs = {
            width: torch.randn(rows, width, dtype=weight.dtype, device=weight.device)
            for width in {layer.in_features for layer in layers}
        }
        for kernel in kernels:  # warm-up (oneDNN builds its primitives on first use)
            _one_pass(layers, inputs, kernel)
        for _ in range(REPEATS):
            for kernel in kernels:
                t = _one_pass(layers, inputs, kernel)
                ms[kernel][label] = min(ms[kernel].get(label, float("inf")), t)
    for layer in layers:  # packed only to be timed: the model packs what it runs on use
        if id(layer.weight) not in packed_before:
            exact.forget(layer.weight)
    best = {label: min(kernels, key=lambda k: ms[k][label]) for label in _labels()}
    stateless = [k for k in kernels if k not in PER_SHAPE_STATE] or list(kernels)
    best["prefill"] = min(stateless, key=lambda k: ms[k]["prefill"])
    measurements += 1
    return AutoChoice(tuple(best[str(r)] for r in range(1, FEW_ROWS + 1)), best["prefill"], ms, key)


def auto_choice(
    model: nn.Module,
    *,
    identity: str | None = None,
    cache_dir: Path | None = None,
    measure: bool = False,
) -> AutoChoice:
    """The fastest kernel of ``model``'s linear layers per row count on this machine, read
    from the cache when it holds one for this key, else measured (a few seconds) and
    written there (module docstring). ``identity`` names the weights (e.g. their sha256);
    ``cache_dir`` defaults to :func:`default_cache_dir`; ``measure`` measures again even
    when the cache holds a choice, and replaces it (a choice measured on a busy machine)."""
    key = choice_key(model, identity)
    path = cache_file(key, cache_dir)
    choice = None if measure else _read(path, key)
    if choice is not None:
        return choice
    choice = _measure(model, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choice.to_json(), indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError:  # a read-only store: the choice still holds for this process
        pass
    return choice


def set_auto_kernel(
    model: nn.Module, *, identity: str | None = None, cache_dir: Path | None = None
) -> int:
    """Make ``model``'s linear layers run ``"auto"``: the fastest kernel this machine measured
    for each row count (:func:`auto_choice`, measured over the plain layers, not a previous
    kernel); return how many layers run it (:func:`~kakeya_lab.linear.set_linear_kernel`)."""
    set_linear_kernel(model, "aten")
    return set_linear_kernel(
        model, "auto", choice=auto_choice(model, identity=identity, cache_dir=cache_dir)
    )
