"""The cache explorer: which tokens a sink-window cache holds, step by step.

Every step is computed up front (:func:`record_cache_steps`) and drawn as one plotly
figure with a slider over precomputed frames (:func:`cache_explorer_figure`). Nothing
calls back into Python, so the slider moves in committed output, in
``jupyter nbconvert --to html`` and in JupyterLab before any cell has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from kakeya_lab.verifier import Verifier

STATUS_COLORS = {
    "sink": "#9ecae1",
    "window": "#a1d99b",
    "evicted": "#e0e0e0",
    "unseen": "rgba(0,0,0,0)",
}


def record_cache_steps(
    verifier: Verifier, token_ids: Sequence[int], chunk: int = 1
) -> list[list[int]]:
    """Append ``token_ids`` ``chunk`` at a time; the cached positions after every append."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    steps = []
    ids = list(token_ids)
    for i in range(0, len(ids), chunk):
        verifier.append(ids[i : i + chunk])
        steps.append(verifier.cached_positions())
    return steps


def cache_status(cached: Sequence[int], seen: int, sink: int, total: int) -> list[str]:
    """Per position ``0..total-1``: ``sink``, ``window``, ``evicted`` or ``unseen``
    (not yet appended), given the positions ``cached`` after ``seen`` tokens."""
    held = set(cached)
    out = []
    for pos in range(total):
        if pos >= seen:
            out.append("unseen")
        elif pos in held:
            out.append("sink" if pos < sink else "window")
        else:
            out.append("evicted")
    return out


def _label(piece: str) -> str:
    shown = piece.replace("\n", "⏎").strip() or "␣"
    return shown if len(shown) <= 6 else shown[:5] + "…"


def cache_explorer_figure(
    tokenizer,
    history_ids: Sequence[int],
    steps: Sequence[Sequence[int]],
    sink: int,
    *,
    columns: int = 16,
    title: str = "Cache explorer",
) -> go.Figure:
    """A token grid coloured by cache status, one slider frame per step of ``steps``.

    ``steps[i]`` are the cached positions after step ``i`` (see :func:`record_cache_steps`);
    the number of tokens seen at a step is one past its largest cached position. The
    figure opens on the last step.
    """
    if not steps:
        raise ValueError("no steps to show: record at least one append")
    ids = list(history_ids)
    total = max(max(s) + 1 for s in steps if s)
    pieces = [tokenizer.decode([t]) for t in ids[:total]]
    xs = [pos % columns for pos in range(total)]
    ys = [-(pos // columns) for pos in range(total)]
    hover = [f"position {pos}: {piece!r}" for pos, piece in enumerate(pieces)]

    def frame_of(i: int) -> tuple[dict, str]:
        cached = steps[i]
        seen = max(cached) + 1 if cached else 0
        status = cache_status(cached, seen, sink, total)
        counts = {name: status.count(name) for name in ("sink", "window", "evicted")}
        caption = (
            f"step {i}: {seen} tokens seen, cache holds {counts['sink']} sink + "
            f"{counts['window']} window, {counts['evicted']} evicted"
        )
        marker = {
            "color": [STATUS_COLORS[s] for s in status],
            "symbol": "square",
            "size": 30,
            "line": {"width": 1, "color": ["#999" if s != "unseen" else "#eee" for s in status]},
        }
        text = [pieces[p] if status[p] != "unseen" else "" for p in range(total)]
        return {"marker": marker, "text": [_label(t) if t else "" for t in text]}, caption

    last = len(steps) - 1
    data, caption = frame_of(last)
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="markers+text",
            textfont={"size": 9},
            hovertext=hover,
            hoverinfo="text",
            showlegend=False,
            **data,
        )
    )
    for name in ("sink", "window", "evicted"):  # legend entries only
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                name=name,
                marker={"color": STATUS_COLORS[name], "symbol": "square", "size": 12},
            )
        )
    frames, slider_steps = [], []
    for i in range(len(steps)):
        data_i, caption_i = frame_of(i)
        frames.append(
            go.Frame(
                name=str(i),
                data=[go.Scatter(**data_i)],
                traces=[0],
                layout={"title": {"text": f"{title}<br><sub>{caption_i}</sub>"}},
            )
        )
        slider_steps.append(
            {
                "label": str(i),
                "method": "animate",
                "args": [
                    [str(i)],
                    {
                        "mode": "immediate",
                        "frame": {"duration": 0, "redraw": True},
                        "transition": {"duration": 0},
                    },
                ],
            }
        )
    fig.frames = frames
    rows = (total + columns - 1) // columns
    fig.update_layout(
        title={"text": f"{title}<br><sub>{caption}</sub>"},
        sliders=[
            {
                "active": last,
                "steps": slider_steps,
                "currentvalue": {"prefix": "step "},
                "pad": {"t": 30},
            }
        ],
        xaxis={"visible": False, "range": [-0.7, columns - 0.3]},
        yaxis={"visible": False, "range": [-rows + 0.3, 0.7]},
        height=170 + 38 * rows,
        # the legend sits right of the grid, in its own margin, never over a token cell
        margin={"l": 10, "r": 110, "t": 80, "b": 10},
        plot_bgcolor="white",
        legend={"orientation": "v", "x": 1.01, "xanchor": "left", "y": 1, "yanchor": "top"},
    )
    return fig
