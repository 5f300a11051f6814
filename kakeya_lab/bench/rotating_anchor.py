"""The anchor: mlx-lm's own ``RotatingKVCache`` under speculative decoding, past the window.

:func:`run_rotating_anchor` decodes the same prompt (longer than the budget) four ways —
mlx-lm's ``generate_step`` (greedy) and ``speculative_generate_step`` over
``RotatingKVCache(max_size=sink + window, keep=sink)``, and kakeya_lab's plain and
speculative decoding over our sink-window cache with the same budget — with the same model
and the same early-exit draft, and reports where each speculative stream first departs
from greedy decoding of its own cache.

Two things in mlx-lm 0.32.2's ``RotatingKVCache`` make its speculative stream depart (read
from the installed source; the result reports the first departure, not its cause):

* a multi-token block (the verification of ``[x, d1..dk]``) is masked by
  ``create_causal_mask(N, offset, window_size=max_size)`` over the concatenated
  ``[keep | window | block]`` columns: a plain sliding window that ignores ``keep``, so the
  2nd..Nth queries of a block lose sink columns that single-token decoding keeps;
* once ``offset >= max_size`` the cache is not trimmable and ``trim_prompt_cache`` returns 0
  without trimming (the check at the start of ``speculative_generate_step`` passes because
  a fresh cache is empty), so rejected drafts stay in the verifier's cache.

Ours gives every block position the oracle's context and rewinds after the wrap, so its
speculative stream equals its plain stream.

:func:`time_decode_step` (a benchmark, not a test) times one decode step of our MLX
sink-window cache against ``RotatingKVCache`` at the same live length.
:func:`oracle_agreement` checks our MLX cache against the dense masked oracles on a short
case past eviction, and :func:`anchor_streams_figure` draws the anchor's streams
(notebook ``15_mlx_backend``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import version
from typing import Any

from kakeya_lab.backends.config import SinkWindowConfig


@dataclass(frozen=True)
class RotatingAnchorResult:
    """Two streams per cache, compared token by token.

    ``*_departure_index``: first index where the speculative stream differs from plain
    greedy decoding of the same cache (None: identical over ``new_tokens``);
    ``*_departure_tokens``: ``(greedy, speculative)`` at that index.
    ``rotating_rejections_past_wrap``: draft rejections mlx-lm had to rewind after the
    cache was full (each one a trim that could not happen).
    """

    mlx_lm_version: str
    sink: int
    window: int
    max_size: int
    prompt_tokens: int
    new_tokens: int
    num_draft_tokens: int
    draft_layers: int
    rotating_greedy: list[int]
    rotating_speculative: list[int]
    rotating_departure_index: int | None
    rotating_departure_tokens: tuple[int, int] | None
    rotating_rejections_past_wrap: int
    ours_greedy: list[int]
    ours_speculative: list[int]
    ours_departure_index: int | None
    ours_departure_tokens: tuple[int, int] | None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        def say(name: str, index: int | None, tokens: tuple[int, int] | None) -> str:
            if index is None or tokens is None:  # set together
                return f"{name}: speculative == greedy over {self.new_tokens} tokens"
            return f"{name}: departs at token {index} (greedy {tokens[0]}, speculative {tokens[1]})"

        return "\n".join(
            [
                f"mlx-lm {self.mlx_lm_version}, budget {self.max_size} (keep {self.sink}), prompt "
                f"{self.prompt_tokens} tokens, {self.new_tokens} new, {self.num_draft_tokens} drafts/step, "
                f"early-exit draft with {self.draft_layers} layers",
                say(
                    "mlx-lm RotatingKVCache",
                    self.rotating_departure_index,
                    self.rotating_departure_tokens,
                )
                + f" ({self.rotating_rejections_past_wrap} rejections past the wrap)",
                say(
                    "kakeya_lab sink-window", self.ours_departure_index, self.ours_departure_tokens
                ),
            ]
        )


def _departure(a: Sequence[int], b: Sequence[int]) -> tuple[int | None, tuple[int, int] | None]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, (x, y)
    return None, None


def run_rotating_anchor(
    model: Any,
    prompt: Sequence[int],
    *,
    sink: int = 4,
    window: int = 28,
    new_tokens: int = 60,
    num_draft_tokens: int = 4,
    draft_layers: int | None = None,
) -> RotatingAnchorResult:
    """Run the anchor on an mlx-lm ``model`` (e.g. :func:`kakeya_lab.backends.mlx_backend.load_mlx_model`).

    ``prompt`` should be longer than ``sink + window`` so decoding starts past the wrap.
    The draft is the model's first ``draft_layers`` layers (default: a third).
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.models.cache import RotatingKVCache

    from kakeya_lab.backends.mlx_backend import mlx_early_exit_model
    from kakeya_lab.proposers import DraftModelProposer
    from kakeya_lab.session import SessionStore, Token

    max_size = sink + window
    draft_layers = draft_layers or max(1, len(model.layers) // 3)
    draft = mlx_early_exit_model(model, draft_layers)
    prompt = list(prompt)

    def rotating(m: Any) -> list:
        return [RotatingKVCache(max_size=max_size, keep=sink) for _ in m.layers]

    prompt_mx = mx.array(prompt)
    greedy = [
        int(t)
        for t, _ in generate_step(
            prompt_mx, model, max_tokens=new_tokens, prompt_cache=rotating(model)
        )
    ]
    model_cache = rotating(model)
    speculative, rejections = [], 0
    steps = speculative_generate_step(
        prompt_mx,
        model,
        draft,
        num_draft_tokens=num_draft_tokens,
        max_tokens=new_tokens,
        prompt_cache=model_cache + rotating(draft),
    )
    accepted_in_step = 0
    for token, _, from_draft in steps:
        if from_draft:
            accepted_in_step += 1
        else:  # the verifier's own token closes a step; fewer accepted drafts = a rewind
            if accepted_in_step < num_draft_tokens and model_cache[0].offset > max_size:
                rejections += 1
            accepted_in_step = 0
        speculative.append(int(token))

    config = SinkWindowConfig(sink=sink, window=window, positions="global")
    store = SessionStore(model, config, capacity=2, eos_token_ids=[])
    ours = {}
    for name, proposer in (
        ("greedy", None),
        ("speculative", DraftModelProposer(draft, config, label="early-exit")),
    ):
        sid = store.create()
        store.append(sid, prompt)
        events = store.generate(sid, new_tokens, proposer=proposer, draft_length=num_draft_tokens)
        ours[name] = [e.id for e in events if isinstance(e, Token)]
        store.close(sid)

    rot_index, rot_tokens = _departure(greedy, speculative)
    our_index, our_tokens = _departure(ours["greedy"], ours["speculative"])
    return RotatingAnchorResult(
        mlx_lm_version=version("mlx-lm"),
        sink=sink,
        window=window,
        max_size=max_size,
        prompt_tokens=len(prompt),
        new_tokens=new_tokens,
        num_draft_tokens=num_draft_tokens,
        draft_layers=draft_layers,
        rotating_greedy=greedy,
        rotating_speculative=speculative,
        rotating_departure_index=rot_index,
        rotating_departure_tokens=rot_tokens,
        rotating_rejections_past_wrap=rejections,
        ours_greedy=ours["greedy"],
        ours_speculative=ours["speculative"],
        ours_departure_index=our_index,
        ours_departure_tokens=our_tokens,
    )


@dataclass(frozen=True)
class DecodeStepTiming:
    """Median seconds per decode step at ``live_len`` cached entries, measured interleaved in
    one process. ``ratio_*`` = ours / mlx-lm's RotatingKVCache (backend-internal ratio, not a
    speedup)."""

    live_len: int
    steps: int
    rotating_s: float
    ours_cache_s: float
    ours_verifier_s: float
    ratio_cache: float
    ratio_verifier: float


def time_decode_step(
    model: Any, *, sink: int = 4, window: int = 1020, steps: int = 64, rounds: int = 5
) -> DecodeStepTiming:
    """Benchmark (not a test): one decode step of our MLX sink-window cache vs mlx-lm's
    ``RotatingKVCache(max_size=sink + window, keep=sink)``, both full (``live_len = sink +
    window``). ``ours_cache_s``: model forward + commit on :class:`MLXSinkWindowCache`;
    ``ours_verifier_s``: :meth:`Verifier.append` (ids check, logits to torch) on top."""
    import statistics

    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    from kakeya_lab.backends.mlx_backend import MLXSinkWindowCache
    from kakeya_lab.verifier import Verifier

    budget = sink + window
    config = SinkWindowConfig(sink=sink, window=window)
    vocab = model.args.vocab_size
    prefill = [(17 * i + 5) % vocab for i in range(budget + 8)]

    rot = [RotatingKVCache(max_size=budget, keep=sink) for _ in model.layers]
    for chunk in range(0, len(prefill), 256):
        mx.eval(model(mx.array([prefill[chunk : chunk + 256]]), cache=rot))
    ours = MLXSinkWindowCache(model, config)
    for chunk in range(0, len(prefill), 256):
        part = prefill[chunk : chunk + 256]
        mx.eval(model(mx.array([part]), cache=ours.layers))
        ours.commit(len(part))
    verifier = Verifier(model, config)
    verifier.append(prefill)
    assert ours.cache_len == verifier.cache_len == budget

    def rotating_step(token: int) -> None:
        mx.eval(model(mx.array([[token]]), cache=rot))

    def cache_step(token: int) -> None:
        mx.eval(model(mx.array([[token]]), cache=ours.layers))
        ours.commit(1)

    def verifier_step(token: int) -> None:
        verifier.append([token])

    results: dict[str, list[float]] = {"rot": [], "cache": [], "verifier": []}
    for r in range(rounds):
        for name, step in (
            ("rot", rotating_step),
            ("cache", cache_step),
            ("verifier", verifier_step),
        ):
            t0 = time.perf_counter()
            for i in range(steps):
                step((31 * (r * steps + i) + 7) % vocab)
            results[name].append((time.perf_counter() - t0) / steps)
    rot_s, cache_s, ver_s = (statistics.median(results[k]) for k in ("rot", "cache", "verifier"))
    return DecodeStepTiming(
        live_len=budget,
        steps=steps * rounds,
        rotating_s=rot_s,
        ours_cache_s=cache_s,
        ours_verifier_s=ver_s,
        ratio_cache=cache_s / rot_s,
        ratio_verifier=ver_s / rot_s,
    )


@dataclass(frozen=True)
class OracleAgreement:
    """Max |Δlogit| (fp32) of our MLX sink-window cache, decoding token by token, against
    the dense masked MLX forward and the dense masked torch forward of the same weights,
    over ``tokens`` positions (``budget`` = sink + window; eviction starts past it)."""

    tokens: int
    budget: int
    cache_len: int
    kv_live_bytes: int
    kv_budget_bytes: int | None
    vs_mlx_dense: float
    vs_torch_dense: float
    mlx_dense_vs_torch_dense: float


def oracle_agreement(
    mlx_model: Any, torch_model: Any, token_ids: Sequence[int], config: SinkWindowConfig
) -> OracleAgreement:
    """Decode ``token_ids`` one at a time through :class:`~kakeya_lab.verifier.Verifier` on
    ``mlx_model`` and compare every position's logits with
    :func:`~kakeya_lab.backends.mlx_backend.mlx_dense_logits` and
    :func:`kakeya_lab.reference.dense_logits` on ``torch_model`` (the same weights).
    Global positions only (the dense mask is the rolling oracle only up to the budget)."""
    import torch

    from kakeya_lab.backends.mlx_backend import mlx_dense_logits
    from kakeya_lab.reference import dense_logits
    from kakeya_lab.verifier import Verifier

    if config.positions != "global":
        raise ValueError("oracle_agreement compares global positions; use positions='global'")
    ids = list(token_ids)
    verifier = Verifier(mlx_model, config)
    ours = torch.stack([verifier.append([t]) for t in ids])
    mlx_dense = mlx_dense_logits(mlx_model, ids, config)
    torch_dense = dense_logits(torch_model, ids, config)

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max())

    return OracleAgreement(
        tokens=len(ids),
        budget=int(config.budget or len(ids)),
        cache_len=verifier.cache_len,
        kv_live_bytes=verifier.kv_live_bytes,
        kv_budget_bytes=verifier.kv_budget_bytes(),
        vs_mlx_dense=gap(ours, mlx_dense),
        vs_torch_dense=gap(ours, torch_dense),
        mlx_dense_vs_torch_dense=gap(mlx_dense, torch_dense),
    )


def anchor_streams_figure(result: RotatingAnchorResult) -> Any:
    """A plotly figure: for each cache, whether each speculative token equals greedy
    decoding of the same cache (1) or not (0), token by token, the first departure marked."""
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = (
        (
            "mlx-lm RotatingKVCache",
            result.rotating_greedy,
            result.rotating_speculative,
            result.rotating_departure_index,
            "#d62728",
        ),
        (
            "kakeya_lab sink-window",
            result.ours_greedy,
            result.ours_speculative,
            result.ours_departure_index,
            "#1f77b4",
        ),
    )
    for offset, (name, greedy, spec, departure, color) in enumerate(rows):
        same = [int(a == b) for a, b in zip(greedy, spec)]
        fig.add_trace(
            go.Scatter(
                x=list(range(len(same))),
                y=[v + 1.5 * offset for v in same],
                mode="lines+markers",
                line={"shape": "hv", "color": color},
                name=name,
                customdata=list(zip(greedy, spec)),
                hovertemplate="token %{x}: greedy %{customdata[0]}, speculative %{customdata[1]}",
            )
        )
        label = (
            f"{name}: departs at token {departure}"
            if departure is not None
            else f"{name}: equal to greedy over {len(same)} tokens"
        )
        if departure is not None:
            fig.add_vline(x=departure, line={"dash": "dash", "color": color})
        fig.add_annotation(
            x=0,
            y=1.5 * offset + 1.25,
            text=label,
            showarrow=False,
            xanchor="left",
            font={"color": color},
        )
    fig.update_layout(
        title=(
            f"Speculative vs greedy past the window (budget {result.max_size}, keep {result.sink}, "
            f"{result.num_draft_tokens} drafts/step)"
        ),
        xaxis_title="generated token",
        yaxis={
            "tickvals": [0, 1, 1.5, 2.5],
            "ticktext": ["differs", "equal", "differs", "equal"],
            "range": [-0.3, 3.0],
        },
        height=360,
    )
    return fig
