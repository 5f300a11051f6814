"""Plotly figures shared by notebooks and reports. They plot; they compute nothing new."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import plotly.io as pio
from plotly.io.base_renderers import HtmlRenderer
from plotly.subplots import make_subplots

ARM_COLORS = {
    "sink_window": "#1f77b4",
    "full_cache": "#d62728",
    "reprefill": "#2ca02c",
    "grpc_session": "#9467bd",
    "http_reuse": "#17becf",
    "http_stateless": "#ff7f0e",
}


HTML_FALLBACK_RENDERER = "kakeya_lab_html"
NOTEBOOK_RENDERER = f"plotly_mimetype+{HTML_FALLBACK_RENDERER}"


def use_notebook_renderer() -> None:
    """Make ``fig.show()`` in a notebook carry two representations: plotly's mime type
    (JupyterLab draws it, also before any cell has run) and a light HTML fallback, a div
    and the ``Plotly.newPlot`` call that draws it, without plotly.js.

    plotly's own ``notebook`` renderer embeds the 4.7 MB plotly.js bundle in the first
    output of every notebook; here the page that shows the fallback provides plotly.js
    instead: :mod:`kakeya_lab.notebook_html` (``make html``) adds it once per exported page.
    """
    if HTML_FALLBACK_RENDERER not in pio.renderers:
        # plotly's NotebookRenderer without its global_init, the step that embeds plotly.js
        pio.renderers[HTML_FALLBACK_RENDERER] = HtmlRenderer(
            connected=False, full_html=False, global_init=False, include_plotlyjs=False
        )
    pio.renderers.default = NOTEBOOK_RENDERER


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


def prefill_figure(turns: pd.DataFrame, title: str = "Per-turn prefill") -> go.Figure:
    """Prefill of each turn (``append_latency_s``: the new message for a session, the whole
    conversation for a stateless arm) against turn, one line per arm, log scale."""
    fig = go.Figure()
    for arm, df in turns.groupby("arm", sort=False):
        fig.add_trace(
            go.Scatter(
                x=df["turn"],
                y=df["append_latency_s"] * 1e3,
                mode="lines+markers",
                name=arm,
                line=dict(color=_color(arm)),
            )
        )
    fig.update_layout(
        title=title, xaxis_title="turn", yaxis=dict(title="ms", type="log"), height=380
    )
    return fig


def prefill_history_figure(
    turns: pd.DataFrame,
    fits: dict[str, dict],
    title: str = "Prefill against history length",
) -> go.Figure:
    """Each arm's per-turn prefill (``append_latency_s``) against the history it was
    appended to, in its own panel, with the slope the summary fitted (``fits[arm]``: the
    history-slope verdict, ``slope_s_per_token``, ``slope_ci95``, ``bounded``) drawn
    through the mean point of the turns after the cache filled. A flat line inside its
    interval is what a bounded prefill looks like; a stateless arm's line climbs."""
    arms = [str(a) for a in turns["arm"].unique()]
    titles = []
    for arm in arms:
        fit = fits.get(arm) or {}
        slope, ci = fit.get("slope_s_per_token"), fit.get("slope_ci95")
        titles.append(
            f"{arm}: not fitted ({fit.get('reason') or 'no verdict'})"
            if slope is None or ci is None
            else f"{arm}: {slope * 1e6:.2f} us/token [{ci[0] * 1e6:.2f}, {ci[1] * 1e6:.2f}]"
        )
    cols = max(1, min(3, len(arms)))
    n_rows = max(1, -(-len(arms) // cols))
    fig = make_subplots(rows=n_rows, cols=cols, subplot_titles=titles, vertical_spacing=0.18)
    for i, arm in enumerate(arms):
        row, col = divmod(i, cols)
        row, col = row + 1, col + 1
        df = turns[turns["arm"] == arm]
        if "error" in df:
            df = df[df["error"].isna()]
        color = _color(arm)
        fig.add_trace(
            go.Scatter(
                x=df["history_len"],
                y=df["append_latency_s"] * 1e3,
                mode="markers",
                name=arm,
                marker=dict(color=color, size=5),
                customdata=df["turn"],
                hovertemplate="turn %{customdata}<br>%{y:.1f} ms",
            ),
            row,
            col,
        )
        fit = fits.get(arm) or {}
        slope, start = fit.get("slope_s_per_token"), fit.get("from_turn")
        fitted = df if start is None else df[df["turn"] >= start]
        if slope is not None and len(fitted):
            x0, y0 = fitted["history_len"].mean(), fitted["append_latency_s"].mean()
            xs = [fitted["history_len"].min(), fitted["history_len"].max()]
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[(y0 + slope * (x - x0)) * 1e3 for x in xs],
                    mode="lines",
                    line=dict(color=color, dash="dash"),
                    name=f"{arm} fitted slope",
                    showlegend=False,
                ),
                row,
                col,
            )
    fig.update_xaxes(title_text="history length (tokens)")
    fig.update_yaxes(title_text="prefill (ms)", rangemode="tozero")
    fig.update_layout(title=title, height=60 + 320 * n_rows, showlegend=False)
    return fig


def kv_bytes_figure(
    turns: pd.DataFrame, budget_bytes: int | None = None, title: str = "KV cache bytes held"
) -> go.Figure:
    """``kv_live_bytes`` after each turn, one line per arm, with the analytic budget."""
    fig = go.Figure()
    for arm, df in turns.groupby("arm", sort=False):
        fig.add_trace(
            go.Scatter(
                x=df["history_len"],
                y=df["kv_live_bytes"] / 2**20,
                mode="lines+markers",
                name=arm,
                line=dict(color=_color(arm)),
                customdata=df["turn"],
                hovertemplate="turn %{customdata}<br>%{y:.2f} MiB",
            )
        )
    if budget_bytes:
        fig.add_hline(
            y=budget_bytes / 2**20,
            line_dash="dash",
            line_color="gray",
            annotation_text="budget (sink + window)",
        )
    fig.update_layout(
        title=title,
        xaxis_title="history length (tokens)",
        yaxis_title="MiB",
        yaxis_rangemode="tozero",
        height=380,
    )
    return fig


def tau_by_draft_length_figure(
    summary: pd.DataFrame, title: str = "Tokens per verifier forward (tau) by draft length"
) -> go.Figure:
    """``tau`` against ``draft_length``, one line per proposer, plain decoding at 1."""
    fig = go.Figure()
    for proposer, df in summary[summary["arm"] != "plain"].groupby("proposer", sort=False):
        fig.add_trace(
            go.Scatter(x=df["draft_length"], y=df["tau"], mode="lines+markers", name=proposer)
        )
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray", annotation_text="plain decoding")
    fig.update_layout(title=title, xaxis_title="draft length", yaxis_title="tau", height=380)
    return fig


def acceptance_by_position_figure(summary: pd.DataFrame) -> go.Figure:
    """P(draft token i accepted | proposed), one line per arm."""
    fig = go.Figure()
    for _, row in summary.iterrows():
        acc = row.get("acceptance_by_position")
        if acc is None or not isinstance(acc, list):
            continue
        fig.add_trace(
            go.Scatter(x=list(range(1, len(acc) + 1)), y=acc, mode="lines+markers", name=row["arm"])
        )
    fig.update_layout(
        title="Acceptance by draft position",
        xaxis_title="draft position",
        yaxis_title="P(accepted | proposed)",
        yaxis_range=[0, 1.02],
        height=380,
    )
    return fig


def speedup_figure(summary: pd.DataFrame) -> go.Figure:
    """Measured speedup vs the Leviathan expectation from the measured acceptance
    probability and draft cost ratio, per arm."""
    spec = summary[summary["arm"] != "plain"]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=spec["arm"], y=spec["speedup"], name="measured"))
    fig.add_trace(
        go.Bar(
            x=spec["arm"],
            y=spec["expected_speedup"],
            name="expected (Leviathan, measured acceptance and cost)",
        )
    )
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    fig.update_layout(
        title="Speedup over plain decoding (same verifier, cache and turns)",
        barmode="group",
        yaxis_title="× plain tokens/s",
        height=400,
    )
    return fig


def cost_model_figure(cost) -> go.Figure:
    """Left: the verifier block cost ``v(n)`` as measured (every repeat), the medians the
    cost model uses, and the least-squares line through them. Right: each arm's speedup
    predicted by the cost model (geometric acceptance, and the measured costs of the steps
    it took) against the measured speedup; on the diagonal the model explains the run.
    ``cost`` is a :class:`~kakeya_lab.bench.speculative_cost.RunCostModel`."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("Verifier block cost v(n)", "Predicted vs measured speedup"),
    )
    sizes = sorted(cost.timings)
    xs = [n for n in sizes for _ in cost.timings[n]]
    ys = [t * 1e3 for n in sizes for t in cost.timings[n]]
    fig.add_trace(
        go.Scatter(x=xs, y=ys, mode="markers", name="measured", marker={"opacity": 0.5}),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(x=sizes, y=[cost.block(n) * 1e3 for n in sizes], mode="lines", name="median"),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=sizes,
            y=[cost.block.line(n) * 1e3 for n in sizes],
            mode="lines",
            line={"dash": "dot"},
            name=f"line {cost.block.fixed_s * 1e3:.1f} + {cost.block.per_token_s * 1e3:.2f}·n ms",
        ),
        row=1,
        col=1,
    )
    arms = cost.arms.dropna(subset=["speedup"])
    for column, label, symbol in (
        ("predicted_speedup", "predicted (acceptance model)", "circle"),
        ("step_cost_speedup", "from the steps taken", "diamond"),
    ):
        fig.add_trace(
            go.Scatter(
                x=arms["speedup"],
                y=arms[column],
                mode="markers+text",
                text=arms["arm"],
                textposition="top center",
                marker={"symbol": symbol, "size": 9},
                name=label,
            ),
            row=1,
            col=2,
        )
    values = [v for c in ("speedup", "predicted_speedup", "step_cost_speedup") for v in arms[c]]
    values = [float(v) for v in values if v is not None and not pd.isna(v)] or [1.0]
    lo, hi = min(0.0, *values), max(1.0, *values) * 1.1
    fig.add_trace(
        go.Scatter(
            x=[lo, hi],
            y=[lo, hi],
            mode="lines",
            line={"dash": "dot", "color": "gray"},
            name="y = x",
        ),
        row=1,
        col=2,
    )
    fig.update_xaxes(title_text="block size n (tokens)", row=1, col=1)
    fig.update_yaxes(title_text="ms per forward", row=1, col=1)
    fig.update_xaxes(title_text="measured speedup (× plain)", row=1, col=2)
    fig.update_yaxes(title_text="predicted speedup (× plain)", row=1, col=2)
    fig.update_layout(title="Cost model of this run", height=420)
    return fig


def speculative_turns_figure(turns: pd.DataFrame) -> go.Figure:
    """Per-turn tau and speedup against history length: does speculation decay with history?"""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tau per turn", "speedup per turn"))
    for arm, df in turns[turns["arm"] != "plain"].groupby("arm", sort=False):
        common = dict(mode="markers", name=arm, legendgroup=arm)
        fig.add_trace(go.Scatter(x=df["history_len"], y=df["tau"], **common), 1, 1)
        fig.add_trace(
            go.Scatter(x=df["history_len"], y=df["speedup"], showlegend=False, **common), 1, 2
        )
    fig.update_xaxes(title_text="history length (tokens)")
    fig.update_layout(height=380, title="Speculation across the session")
    return fig


def rss_figure(turns: pd.DataFrame) -> go.Figure:
    """Process RSS after each turn (one process holds every arm, so the lines overlap)."""
    fig = go.Figure()
    for arm, df in turns.groupby("arm", sort=False):
        fig.add_trace(
            go.Scatter(
                x=df["turn"],
                y=df["rss_bytes"] / 2**30,
                mode="lines",
                name=arm,
                line=dict(color=_color(arm)),
            )
        )
    fig.update_layout(title="Process RSS", xaxis_title="turn", yaxis_title="GiB", height=340)
    return fig


def recall_figure(turns: pd.DataFrame, window: int | None = None) -> go.Figure:
    """Planted-fact recall (1/0) against the distance to the fact, per arm."""
    fig = go.Figure()
    probes = (
        turns[turns["probe_recalled"].notna()] if "probe_recalled" in turns else turns.iloc[0:0]
    )
    for arm, df in probes.groupby("arm", sort=False):
        fig.add_trace(
            go.Scatter(
                x=df["probe_distance_tokens"],
                y=df["probe_recalled"].astype(float),
                mode="markers",
                name=arm,
                marker=dict(color=_color(arm), size=9),
            )
        )
    if window:
        fig.add_vline(x=window, line_dash="dash", line_color="gray", annotation_text="window")
    fig.update_layout(
        title="Recall of a fact planted in turn 0",
        xaxis_title="distance to the fact (tokens)",
        yaxis=dict(title="recalled", tickvals=[0, 1], range=[-0.1, 1.1]),
        height=340,
    )
    return fig


# ------------------------------------------------------------------ proposer alignment


def training_curves_figure(histories: dict[str, pd.DataFrame]) -> go.Figure:
    """Training loss and held-out offline tau against step, one line per drafter."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("training loss (weighted total)", "held-out offline tau (greedy)"),
    )
    for i, (name, h) in enumerate(histories.items()):
        color = px.colors.qualitative.Plotly[i % 10]
        t = h.dropna(subset=["train_total"])
        fig.add_trace(
            go.Scatter(
                x=t["step"], y=t["train_total"], name=name, line_color=color, legendgroup=name
            ),
            row=1,
            col=1,
        )
        e = h.dropna(subset=["offline_tau"])
        fig.add_trace(
            go.Scatter(
                x=e["step"],
                y=e["offline_tau"],
                name=name,
                line_color=color,
                legendgroup=name,
                showlegend=False,
                mode="lines+markers",
            ),
            row=1,
            col=2,
        )
    fig.update_xaxes(title_text="step")
    fig.update_layout(height=380)
    return fig


def offline_acceptance_figure(histories: dict[str, pd.DataFrame]) -> go.Figure:
    """P(first i+1 drafts all right) on held-out windows, before (step 0) and after training."""
    rows = []
    for name, h in histories.items():
        e = h.dropna(subset=["offline_tau"])
        cols = sorted(
            (c for c in e.columns if c.startswith("accept_at_")),
            key=lambda c: int(c.rsplit("_", 1)[1]),
        )
        for label, row in (("before", e.iloc[0]), ("after", e.iloc[-1])):
            for c in cols:
                rows.append(
                    {
                        "drafter": name,
                        "when": label,
                        "position": int(c.rsplit("_", 1)[1]) + 1,
                        "accepted": row[c],
                    }
                )
    df = pd.DataFrame(rows)
    fig = px.line(
        df,
        x="position",
        y="accepted",
        color="drafter",
        line_dash="when",
        markers=True,
        title="Held-out acceptance by draft position, before and after training (offline, greedy)",
    )
    fig.update_layout(yaxis_title="P(drafts 1..i all accepted)", xaxis_dtick=1, height=380)
    return fig


def domain_figure(summary: pd.DataFrame, metric: str = "tau") -> go.Figure:
    """``metric`` per domain and arm, held-out (dev) beside in-domain (train) prompts."""
    df = summary if metric == "tau" else summary[summary["arm"] != "plain"]
    fig = px.bar(
        df,
        x="domain",
        y=metric,
        color="arm",
        barmode="group",
        facet_col="split",
        category_orders={"split": ["dev", "train"]},
        title=f"{metric} by domain: held-out (dev) vs in-domain (train) prompts",
    )
    if metric == "speedup":
        fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    fig.update_layout(height=400)
    return fig


def speedup_vs_draft_length_figure(summary: pd.DataFrame) -> go.Figure:
    """Measured speedup and the Leviathan expectation (measured acceptance probability and
    draft cost ratio) against draft length."""
    spec = summary[summary["arm"] != "plain"].sort_values("draft_length")
    fig = go.Figure()
    for i, (proposer, df) in enumerate(spec.groupby("proposer", sort=False)):
        color = px.colors.qualitative.Plotly[i % 10]
        fig.add_trace(
            go.Scatter(
                x=df["draft_length"],
                y=df["speedup"],
                name=f"{proposer} measured",
                mode="lines+markers",
                line_color=color,
            )
        )
        fig.add_trace(
            go.Scatter(
                x=df["draft_length"],
                y=df["expected_speedup"],
                name=f"{proposer} expected",
                mode="lines+markers",
                line=dict(color=color, dash="dash"),
            )
        )
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    fig.update_layout(
        title="Speedup vs draft length (held-out chit-chat)",
        xaxis_title="draft length",
        yaxis_title="× plain tokens/s",
        xaxis_dtick=1,
        height=400,
    )
    return fig


def bucket_figure(
    summary: dict[str, dict], by: str = "time", title: str | None = None
) -> go.Figure:
    """The bucket table of a long run's report (``buckets_by_time`` or ``buckets_by_turns``
    of every arm's summary): p50 and p95 turn latency and mean ``kv_live_bytes`` per bucket,
    one colour per arm (p95 dashed)."""
    if by not in ("time", "turns"):
        raise ValueError(f"by must be 'time' or 'turns', got {by!r}")
    key = f"buckets_by_{by}"
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("turn latency per bucket", "mean KV bytes per bucket")
    )
    for arm, s in summary.items():
        rows = pd.DataFrame(
            s.get(key) or [], columns=["index", "turns", "p50_s", "p95_s", "kv_live_bytes_mean"]
        )
        if by == "time":
            x = rows["index"] * float(s.get("seconds_per_bucket") or 600.0) / 60.0
        else:
            x = rows["index"] * int(s.get("turns_per_bucket") or 50)
        common = dict(mode="lines+markers", legendgroup=arm, customdata=rows["turns"])
        fig.add_trace(
            go.Scatter(
                x=x,
                y=rows["p50_s"] * 1e3,
                name=f"{arm} p50",
                line=dict(color=_color(arm)),
                hovertemplate="%{y:.1f} ms (%{customdata} turns)",
                **common,
            ),
            1,
            1,
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=rows["p95_s"] * 1e3,
                name=f"{arm} p95",
                line=dict(color=_color(arm), dash="dash"),
                hovertemplate="%{y:.1f} ms (%{customdata} turns)",
                **common,
            ),
            1,
            1,
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=rows["kv_live_bytes_mean"] / 2**20,
                name=f"{arm} KV",
                line=dict(color=_color(arm)),
                showlegend=False,
                hovertemplate="%{y:.2f} MiB (%{customdata} turns)",
                **common,
            ),
            1,
            2,
        )
    fig.update_xaxes(title_text="bucket start (minutes)" if by == "time" else "bucket start (turn)")
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="MiB", rangemode="tozero", row=1, col=2)
    fig.update_layout(
        title=title or f"Long run by {'wall-clock' if by == 'time' else 'turn'} bucket", height=380
    )
    return fig


def spec_table_figure(long: pd.DataFrame) -> go.Figure:
    """Speedup over plain decoding per method, one bar per held-out domain (the
    Spec-Bench-style table of :mod:`kakeya_lab.bench.spec_table`), tau on each bar."""
    fig = go.Figure()
    rows = long[long["arm"] != "plain"]
    for domain, df in rows.groupby("domain", sort=False):
        fig.add_trace(
            go.Bar(
                x=df["arm"],
                y=df["speedup"],
                name=str(domain),
                text=[f"τ {t:.2f}" if pd.notna(t) else "" for t in df["tau"]],
                textposition="outside",
            )
        )
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    fig.update_layout(
        title="Speedup over plain decoding by held-out domain (same model, cache and turns)",
        barmode="group",
        yaxis_title="× plain tokens/s",
        height=450,
    )
    return fig


def run_monitor_figure(
    turns: pd.DataFrame,
    budget_bytes: int | None = None,
    bucket_turns: int = 10,
    title: str = "Long run, live",
) -> go.Figure:
    """What a running long run has written so far, one colour per arm: KV bytes after each
    turn against the analytic ``budget_bytes``; turn latency (append + generate) p50 and p95
    per bucket of ``bucket_turns`` turns; prefill (append latency) against history length;
    and failed turns so far. ``turns`` has the rows of ``turns.csv``."""
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=(
            "KV bytes held (MiB)",
            f"turn latency per {bucket_turns} turns (s): p50 solid, p95 dotted",
            "prefill (append latency, ms) against history",
            "failed turns so far",
        ),
        vertical_spacing=0.16,
    )
    for arm, df in turns.groupby("arm", sort=False):
        colour = dict(color=_color(str(arm)))
        common = dict(name=str(arm), legendgroup=str(arm), line=colour, marker=colour)
        fig.add_trace(
            go.Scatter(x=df["turn"], y=df["kv_live_bytes"] / 2**20, mode="lines", **common), 1, 1
        )
        latency = df["append_latency_s"] + df["generate_s"].fillna(0)
        bucket = df["turn"] // bucket_turns
        stats = latency.groupby(bucket).quantile([0.5, 0.95]).unstack()
        x = (stats.index + 0.5) * bucket_turns
        fig.add_trace(
            go.Scatter(x=x, y=stats[0.5], mode="lines+markers", showlegend=False, **common), 1, 2
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=stats[0.95],
                mode="lines+markers",
                showlegend=False,
                name=f"{arm} p95",
                legendgroup=str(arm),
                line=dict(color=_color(str(arm)), dash="dot"),
                marker=colour,
            ),
            1,
            2,
        )
        fig.add_trace(
            go.Scatter(
                x=df["history_len"],
                y=df["append_latency_s"] * 1e3,
                mode="markers",
                showlegend=False,
                **common,
            ),
            2,
            1,
        )
        failed = df["error"].notna() & (df["error"].astype(str) != "")
        fig.add_trace(
            go.Scatter(x=df["turn"], y=failed.cumsum(), mode="lines", showlegend=False, **common),
            2,
            2,
        )
    if budget_bytes:
        fig.add_hline(
            y=budget_bytes / 2**20,
            line_dash="dash",
            line_color="gray",
            annotation_text="budget",
            row=1,
            col=1,
        )
    fig.update_xaxes(title_text="turn", row=1, col=1)
    fig.update_xaxes(title_text="turn", row=1, col=2)
    fig.update_xaxes(title_text="history (tokens)", row=2, col=1)
    fig.update_xaxes(title_text="turn", row=2, col=2)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(title=title, height=620)
    return fig


def server_monitor_figure(samples: pd.DataFrame, title: str = "Server, live") -> go.Figure:
    """A server's ``/metrics`` sampled over time (the rows of
    :func:`kakeya_lab.widgets.monitor.server_samples`): open sessions, KV bytes held,
    tokens generated per second, and failed requests so far."""
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=("open sessions", "KV bytes held (MiB)", "tokens/s", "failed requests"),
        vertical_spacing=0.16,
    )
    t = samples["elapsed_s"]
    line = dict(mode="lines+markers", showlegend=False)
    fig.add_trace(go.Scatter(x=t, y=samples["sessions_open"], **line), 1, 1)
    fig.add_trace(go.Scatter(x=t, y=samples["kv_live_bytes"] / 2**20, **line), 1, 2)
    fig.add_trace(go.Scatter(x=t, y=samples["tokens_per_s"], **line), 2, 1)
    fig.add_trace(go.Scatter(x=t, y=samples["errors_total"], **line), 2, 2)
    fig.update_xaxes(title_text="seconds")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(title=title, height=560)
    return fig
