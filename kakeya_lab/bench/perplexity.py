"""Per-token negative log-likelihood of a long text under different attention budgets
(the attention-sink experiment of Xiao et al. 2023, "StreamingLLM").

* :func:`streaming_nll` — the text streamed through a :class:`~kakeya_lab.verifier.Verifier`
  with a given :class:`~kakeya_lab.backends.config.SinkWindowConfig` (dense = ``window=None``,
  window-only = ``sink=0``, sink + window in either position mode). Each token is scored
  with exactly the oracle's context.
* :func:`sliding_recompute_nll` — sliding window with re-computation: every block of
  ``stride`` targets is scored by a fresh dense forward over the ``window`` tokens before
  it (no cache; the quality reference at quadratic cost).

The experiment (notebook 10) as one unit: :class:`PerplexitySettings` (validated once),
:func:`run_perplexity` (every curve and the table) and :func:`save_perplexity` (its run
folder: ``metrics.json``, ``nll.npz``, figures).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.bench.report import perplexity_table
from kakeya_lab.durable import write_atomic
from kakeya_lab.results import run_header, write_run
from kakeya_lab.settings import Settings, check_int
from kakeya_lab.verifier import Verifier


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none").numpy()


def streaming_nll(
    model,
    token_ids: Sequence[int],
    config: SinkWindowConfig,
    *,
    chunk: int = 64,
    progress: bool = False,
) -> np.ndarray:
    """NLL of ``token_ids[1:]`` (nats), each predicted under the sink-window rule."""
    ids = list(token_ids)
    if len(ids) < 2:
        raise ValueError("need at least two tokens")
    v = Verifier(model, config)
    out = []
    for i in tqdm(range(0, len(ids) - 1, chunk), disable=not progress, desc=str(config.to_dict())):
        block = ids[i : i + chunk]
        logits = v.forward_block(block)
        v.commit(len(block))
        targets = torch.tensor(ids[i + 1 : i + 1 + len(block)])
        out.append(_nll(logits[: len(targets)], targets))
    return np.concatenate(out)


@torch.inference_mode()
def sliding_recompute_nll(
    model, token_ids: Sequence[int], *, window: int, stride: int = 32, progress: bool = False
) -> np.ndarray:
    """NLL of ``token_ids[1:]`` where target ``t`` sees at most the ``window`` tokens
    before it, recomputed from scratch for every ``stride`` targets (positions from 0)."""
    from kakeya_lab.backends.torch_attention import standard_attention

    ids = list(token_ids)
    out = np.zeros(len(ids) - 1)
    with standard_attention(model):
        for end in tqdm(range(1, len(ids), stride), disable=not progress, desc="sliding recompute"):
            last = min(end + stride, len(ids))  # targets ids[end:last]
            start = max(0, last - 1 - window)  # context covers the last target's window
            x = torch.tensor([ids[start : last - 1]])
            logits = model(input_ids=x, use_cache=False).logits[0]
            rel = torch.arange(end - 1 - start, last - 1 - start)
            out[end - 1 : last - 1] = _nll(logits[rel], torch.tensor(ids[end:last]))
    return out


def moving_average(values: np.ndarray, width: int) -> np.ndarray:
    if width <= 1:
        return values
    kernel = np.ones(width) / width
    return np.convolve(values, kernel, mode="valid")


@dataclass(frozen=True)
class PerplexitySettings(Settings):
    """The attention-sink experiment: the first ``n_tokens`` of a text scored ``chunk``
    tokens at a time under a ``sink`` + ``window`` budget (both position modes), beside
    dense attention, a window alone and sliding recompute every ``stride`` targets;
    ``smooth``: the moving-average width of the plotted NLL."""

    model: str = "smollm2-135m-instruct"
    n_tokens: int = 768
    sink: int = 4
    window: int = 124
    chunk: int = 64
    stride: int = 32
    smooth: int = 32

    def validate(self) -> None:
        """Raise :class:`~kakeya_lab.settings.SettingsError` for a setting that cannot work."""
        check_int("n_tokens", self.n_tokens, 2)
        check_int("sink", self.sink, 0)
        for name in ("window", "chunk", "stride", "smooth"):
            check_int(name, getattr(self, name), 1)


@dataclass
class PerplexityRun:
    """Per-token NLL by attention rule (``curves``) and their perplexities (``table``,
    :func:`~kakeya_lab.bench.report.perplexity_table`) over ``n_tokens`` tokens."""

    curves: dict[str, np.ndarray]
    table: pd.DataFrame
    n_tokens: int


def run_perplexity(model, settings: PerplexitySettings, token_ids: Sequence[int]) -> PerplexityRun:
    """Score the first ``settings.n_tokens`` of ``token_ids`` under every rule."""
    ids = list(token_ids)[: settings.n_tokens]
    sink, window, chunk = settings.sink, settings.window, settings.chunk
    curves = {
        "dense": streaming_nll(model, ids, SinkWindowConfig(0, None), chunk=chunk),
        "window only": streaming_nll(model, ids, SinkWindowConfig(0, window), chunk=chunk),
        "sink + window, global": streaming_nll(
            model, ids, SinkWindowConfig(sink, window, "global"), chunk=chunk
        ),
        "sink + window, rolling": streaming_nll(
            model, ids, SinkWindowConfig(sink, window, "rolling"), chunk=chunk
        ),
        "sliding + recompute": sliding_recompute_nll(
            model, ids, window=sink + window, stride=settings.stride
        ),
    }
    table = perplexity_table(curves, budget_tokens=sink + window)
    return PerplexityRun(curves=curves, table=table, n_tokens=len(ids))


def save_perplexity(
    run_dir: str | Path,
    settings: PerplexitySettings,
    model: Any,
    run: PerplexityRun,
    *,
    text: str,
    experiment: str = "sink_window_cache",
    run_id: str | None = None,
    started: str | None = None,
    figures: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``run`` into ``run_dir``: ``metrics.json`` (the perplexity table; headline
    the perplexity past the window by rule), ``nll.npz`` (every curve) and ``figures``.
    ``text``: what was scored, for the header. Returns the path of ``metrics.json``."""
    out = Path(run_dir)
    header = run_header(
        experiment=experiment,
        run_id=run_id or out.resolve().name,
        model=model,
        cache={"sink": settings.sink, "window": settings.window, "positions": None},
        started=started,
        extra={
            "settings": settings.to_dict(),
            "text": text,
            "n_tokens": run.n_tokens,
            "positions_compared": ["global", "rolling"],
        },
    )
    headline = {name: row["ppl (past the window)"] for name, row in run.table.iterrows()}
    path = write_run(
        out,
        header,
        {"perplexity": run.table.to_dict(orient="index")},
        headline=headline,
        figures=dict(figures or {}),
    )
    buffer = io.BytesIO()
    arrays = {k.replace(" ", "_").replace(",", ""): v for k, v in run.curves.items()}
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    write_atomic(out / "nll.npz", lambda fh: fh.write(buffer.getvalue()))
    return path
