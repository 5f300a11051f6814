"""Plotly figures shared by notebooks and reports. They plot; they compute nothing new."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

ARM_COLORS = {
    "sink_window": "#1f77b4",
    "full_cache": "#d62728",
    "reprefill": "#2ca02c",
}


def _color(arm: str) -> str | None:
    return ARM_COLORS.get(arm)


def turn_latency_figure(turns: pd.DataFrame, title: str = "Per-turn latency") -> go.Figure:
    """Append (prefill) latency and per-token decode latency against turn, one line per arm."""
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("append latency per turn", "decode latency per token")
    )
    for arm, df in turns.groupby("arm", sort=False):
        per_token = df["generate_s"] / df["generated_tokens"].clip(lower=1)
        common = dict(mode="lines+markers", name=arm, legendgroup=arm, line=dict(color=_color(arm)))
        fig.add_trace(go.Scatter(x=df["turn"], y=df["append_latency_s"] * 1e3, **common), 1, 1)
        fig.add_trace(go.Scatter(x=df["turn"], y=per_token * 1e3, showlegend=False, **common), 1, 2)
    fig.update_xaxes(title_text="turn")
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    fig.update_layout(title=title, height=380)
    return fig


def kv_bytes_figure(
    turns: pd.DataFrame, budget_bytes: int | None = None, title: str = "KV cache bytes held"
) -> go.Figure:
    """``kv_live_bytes`` after each turn, one line per arm, with the analytic budget."""
    fig = go.Figure()
    for arm, df in turns.groupby("arm", sort=False):
        fig.add_trace(
            go.Scatter(
                x=df["history_len"], y=df["kv_live_bytes"] / 2**20, mode="lines+markers",
                name=arm, line=dict(color=_color(arm)),
                customdata=df["turn"], hovertemplate="turn %{customdata}<br>%{y:.2f} MiB",
            )
        )
    if budget_bytes:
        fig.add_hline(
            y=budget_bytes / 2**20, line_dash="dash", line_color="gray",
            annotation_text="budget (sink + window)",
        )
    fig.update_layout(
        title=title, xaxis_title="history length (tokens)", yaxis_title="MiB",
        yaxis_rangemode="tozero", height=380,
    )
    return fig
