"""The chat panel: talk to a session in a notebook (ipywidgets).

``ChatPanel(load_model(...), SinkWindowConfig(...))`` shows a message box (Enter sends,
Shift+Enter breaks the line) with Send and Stop, a proposer, draft-length and sampling
(temperature, top-p, seed; greedy by default) selector, New conversation and Export
(Markdown and JSON downloads), a live strip of the cache (sink / window / evicted tokens,
``kv_live_bytes`` against the analytic budget), a per-token latency sparkline with the
latest reply's p50/p95 and the drift of the per-turn mean over the last turns, and the
transcript, which follows the newest text unless the reader has scrolled up. Replies
stream token by token from a background thread
(:class:`~kakeya_lab.widgets.live_chat.LiveChat`), so Stop is handled mid-reply, and a
proposer that loads weights loads there too, with a "loading" status that Stop cancels.
In speculative mode accepted draft tokens are green and the verifier's own tokens orange
(a legend says so). Controls are disabled while a reply streams. Only the last
``keep_turns`` turns stay in the page (bounded DOM), so the panel stays responsive over
hundreds of turns.

The HTML it renders is plain markup with stable class names (``kl-reply``, ``kl-cache``,
``kl-status``) so a browser test can read what is shown.
"""

from __future__ import annotations

import base64
import html
import json

from kakeya_lab.backends import registry
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.widgets.live_chat import (
    STOPPED_BY_USER,
    CacheSnapshot,
    LiveChat,
    ReplyRecord,
    latency_drift,
    plural,
    token_latency_percentiles,
)
from kakeya_lab.widgets.message_box import MessageBox

KIND_STYLE = {"draft": "background:#c7e9c0", "verifier": "background:#fdd0a2"}
_MIB = 2**20


def reply_html(record: ReplyRecord, *, colour_kinds: bool) -> str:
    """The reply as spans, one per token (coloured by kind in speculative mode)."""
    spans = []
    for piece, kind in zip(record.pieces, record.token_kinds):
        style = f' style="{KIND_STYLE[kind]}"' if colour_kinds else ""
        spans.append(f'<span class="kl-token kl-{kind}"{style}>{html.escape(piece)}</span>')
    state = "done" if record.finished else "streaming"
    return (
        f'<div class="kl-reply" data-turn="{record.turn}" data-state="{state}" '
        f'data-tokens="{len(record.token_ids)}" style="white-space:pre-wrap;font-family:inherit;'
        f'padding:4px 8px;border-left:3px solid #6baed6;margin:2px 0 8px 0">'
        + "".join(spans)
        + "</div>"
    )


def user_html(record: ReplyRecord) -> str:
    return (
        f'<div class="kl-user" data-turn="{record.turn}" style="white-space:pre-wrap;'
        f'padding:4px 8px;background:#f0f0f0;border-radius:4px;margin-top:6px">'
        f"<b>you · turn {record.turn}</b> {html.escape(record.user_text)}</div>"
    )


def legend_html() -> str:
    """What the colours of a speculative reply mean."""
    swatch = '<span style="{}; padding:0 6px; margin:0 4px 0 10px">&nbsp;</span>'
    return (
        '<div class="kl-legend" style="font-size:85%">'
        + swatch.format(KIND_STYLE["draft"])
        + "accepted draft token"
        + swatch.format(KIND_STYLE["verifier"])
        + "verifier token (decoded or corrected; every token without a proposer)</div>"
    )


def cache_strip_html(snap: CacheSnapshot) -> str:
    """A bar of held (sink, window) and evicted tokens with the KV bytes against the budget."""
    total = max(1, snap.history_tokens)
    parts = [
        ("sink", snap.sink_tokens, "#6baed6"),
        ("window", snap.window_tokens, "#74c476"),
        ("evicted", snap.evicted_tokens, "#d9d9d9"),
    ]
    bar = "".join(
        f'<div title="{name} {n}" style="width:{100 * n / total:.2f}%;background:{c}"></div>'
        for name, n, c in parts
        if n
    )
    budget = (
        f" of {snap.kv_budget_bytes / _MIB:.2f} MiB budget "
        f"({100 * snap.kv_live_bytes / snap.kv_budget_bytes:.0f}%)"
        if snap.kv_budget_bytes
        else " (no budget: full cache)"
    )
    return (
        f'<div class="kl-cache" data-sink="{snap.sink_tokens}" data-window="{snap.window_tokens}" '
        f'data-evicted="{snap.evicted_tokens}" data-kv-live-bytes="{snap.kv_live_bytes}">'
        f'<div style="display:flex;height:10px;width:100%;border:1px solid #bbb">{bar}</div>'
        f'<div style="font-size:85%">history {snap.history_tokens} tokens: '
        f'<span style="color:#3182bd">sink {snap.sink_tokens}</span> · '
        f'<span style="color:#31a354">window {snap.window_tokens}</span> · '
        f'<span style="color:#777">evicted {snap.evicted_tokens}</span> · '
        f"kv_live_bytes {snap.kv_live_bytes / _MIB:.2f} MiB{budget}</div></div>"
    )


def sparkline_html(
    latencies: list[tuple[int, float]],
    by_turn: list[float],
    width: int = 600,
    height: int = 48,
    *,
    latest: ReplyRecord | None = None,
    drift_turns: int = 20,
) -> str:
    """Per-token latency (ms) over the last tokens of the conversation, turn boundaries dashed,
    with the readouts: p50 / p95 / max of the plotted tokens, the latest reply's p50 / p95
    (``latest``), and the drift of the per-turn mean ms/token (``by_turn``) as the OLS slope
    over the last ``drift_turns`` turns with its 95% interval."""
    if not latencies:
        return '<div class="kl-latency" style="font-size:85%;color:#777">per-token latency: no tokens yet</div>'
    ms = [1e3 * s for _, s in latencies]
    top = max(1e-9, sorted(ms)[int(0.95 * (len(ms) - 1))] * 1.2)
    step = width / max(1, len(ms) - 1)
    points = " ".join(
        f"{i * step:.1f},{height - min(height, height * v / top):.1f}" for i, v in enumerate(ms)
    )
    marks = "".join(
        f'<line x1="{i * step:.1f}" x2="{i * step:.1f}" y1="0" y2="{height}" stroke="#ccc" stroke-dasharray="2,2"/>'
        for i in range(1, len(latencies))
        if latencies[i][0] != latencies[i - 1][0]
    )
    ordered = sorted(ms)
    overall = (
        f"p50 {ordered[len(ordered) // 2]:.1f} ms · p95 "
        f"{ordered[round(0.95 * (len(ordered) - 1))]:.1f} ms · max {ordered[-1]:.1f} ms"
    )
    turn = ""
    if latest is not None:
        p50, p95 = token_latency_percentiles(latest)
        if p50 is not None and p95 is not None:
            turn = f" · turn {latest.turn}: p50 {1e3 * p50:.1f} ms, p95 {1e3 * p95:.1f} ms"
    trend = latency_drift(by_turn, drift_turns)
    if trend is None:
        drift = f" · drift: needs 3 finished turns ({len(by_turn)} so far)"
    else:
        drift = (
            f" · drift over the last {trend.turns} turns {trend.slope_ms:+.2f} ms/token per turn "
            f"(95% CI {trend.low_ms:+.2f} to {trend.high_ms:+.2f})"
        )
    return (
        f'<div class="kl-latency"><svg width="{width}" height="{height}" style="background:#fafafa">'
        f'{marks}<polyline fill="none" stroke="#3182bd" stroke-width="1" points="{points}"/></svg>'
        f'<div style="font-size:85%">per-token latency, last {plural(len(ms), "token")}: '
        f"{overall}{turn}{drift}</div></div>"
    )


def status_html(record: ReplyRecord | None, busy: bool, hint: str | None = None) -> str:
    """The one-line status: idle (with an optional ``hint``), loading a proposer, streaming,
    or how the last reply ended."""
    if hint is not None:
        return f'<div class="kl-status" data-state="hint">{html.escape(hint)}</div>'
    if record is None:
        return (
            '<div class="kl-status" data-state="idle">type a message and press Enter or Send</div>'
        )
    if busy and record.loading:
        return (
            f'<div class="kl-status" data-state="loading">turn {record.turn}: loading '
            f"{html.escape(record.loading)} … (Stop cancels the turn; nothing is sent)</div>"
        )
    if busy:
        return (
            f'<div class="kl-status" data-state="streaming">turn {record.turn}: streaming, '
            f"{plural(len(record.token_ids), 'token')}</div>"
        )
    if record.stop_reason == STOPPED_BY_USER and record.history_start is None:
        return (
            f'<div class="kl-status" data-state="done" data-stop-reason="{record.stop_reason}" '
            f'data-undelivered="0">turn {record.turn}: stopped while loading '
            f"{html.escape(record.proposer)}; nothing was sent (the load goes on in the "
            f"background for the next turn)</div>"
        )
    stop = (
        "stopped by you" if record.stop_reason == STOPPED_BY_USER else f"stop: {record.stop_reason}"
    )
    held = (
        "the session holds exactly the tokens shown"
        if record.undelivered_tokens == 0
        else f"the session committed {record.undelivered_tokens} token(s) the stream never delivered (shown)"
    )
    error = (
        f' · <span style="color:#c00">{html.escape(record.error)}</span>' if record.error else ""
    )
    drafts = record.token_kinds.count("draft")
    spec = f" · {drafts} accepted draft tokens" if record.proposer != "none" else ""
    return (
        f'<div class="kl-status" data-state="done" data-stop-reason="{record.stop_reason}" '
        f'data-undelivered="{record.undelivered_tokens}">turn {record.turn}: '
        f"{plural(len(record.token_ids), 'token')}, "
        f"{stop}{spec} · {held}{error}</div>"
    )


def export_links_html(chat: LiveChat) -> str:
    """Download links for the conversation as Markdown and as JSON
    (:meth:`LiveChat.transcript_markdown`, :meth:`LiveChat.transcript`), as data URLs, so
    they work without a file on the server."""

    def link(cls: str, name: str, mime: str, text: str) -> str:
        data = base64.b64encode(text.encode()).decode()
        return (
            f'<a class="{cls}" download="{name}" href="data:{mime};base64,{data}" '
            f'style="margin-left:10px">{name}</a>'
        )

    return (
        '<span class="kl-export-links">'
        + link("kl-export-md", "conversation.md", "text/markdown", chat.transcript_markdown())
        + link(
            "kl-export-json",
            "conversation.json",
            "application/json",
            json.dumps(chat.transcript(), indent=1),
        )
        + "</span>"
    )


def named_drafter_specs(verifier_sha256: str | None, *, tree: bool = False) -> list[str]:
    """The names of the store's named drafters trained for the verifier weights
    ``verifier_sha256`` (none when it is unknown), sorted; with ``tree``, only those that
    draft trees (feature drafters)."""
    from kakeya_lab.proposers.drafters.named import list_drafters

    if not verifier_sha256:
        return []
    return [
        r["name"]
        for r in list_drafters()
        if r["verifier_sha256"] == verifier_sha256 and (not tree or r["kind"] == "feature")
    ]


def registry_draft_specs(model_name: str | None) -> list[str]:
    """The registry's draft model for ``model_name`` (:attr:`ModelSpec.draft
    <kakeya_lab.models.ModelSpec.draft>`, e.g. ``draft:smollm2-135m-instruct:int4``) when the
    verifier is a registry model, one was measured for it and its draft model is pulled;
    an ``int4`` draft also on ``int4-vnni`` (the same weights, cheaper steps) where this CPU
    runs that kernel."""
    from kakeya_lab.models import REGISTRY
    from kakeya_lab.models.store import folder_present, model_dir
    from kakeya_lab.native.int4 import why_unavailable
    from kakeya_lab.proposers import draft_model_spec

    spec = REGISTRY[model_name].draft if model_name in REGISTRY else ""
    if not spec:
        return []
    draft_name, kernel = draft_model_spec(spec.partition(":")[2])
    if not folder_present(model_dir(draft_name)):
        return []
    if kernel == "int4" and not why_unavailable():
        return [spec, f"draft:{draft_name}:int4-vnni"]
    return [spec]


def offered_proposer_specs(
    model_name: str | None, verifier_sha256: str | None, backend: str
) -> tuple[str, ...]:
    """The proposer specs the panel offers, from the proposer registry: ``none``, then for
    each registered kind that runs on ``backend`` its example when it needs nothing or the
    verifier, the registry's measured draft model (:func:`registry_draft_specs`) when it
    needs a draft model, and ``KIND:NAME`` for every named drafter trained for this
    verifier when it needs one (:func:`named_drafter_specs`)."""
    from kakeya_lab.proposers import proposer_kinds

    specs = ["none"]
    for kind in proposer_kinds():
        if kind.wraps or (kind.backends and backend not in kind.backends):
            continue
        if kind.needs in ("nothing", "verifier"):
            specs.append(kind.example)
        elif kind.needs == "draft model":
            specs += registry_draft_specs(model_name)
        elif kind.needs == "named drafter":
            names = named_drafter_specs(verifier_sha256, tree=kind.tree)
            specs += [f"{kind.name}:{name}" for name in names]
    return tuple(dict.fromkeys(specs))


class ChatPanel:
    """An ipywidgets chat with a session; see the module docstring.

    ``source``: a loaded model (``load_model``) or a ``SessionStore`` (then pass
    ``tokenizer``); ``config`` the sink-window cache for a new store. ``proposers`` are
    the proposer specs offered; by default every registered kind's
    (:func:`offered_proposer_specs`): the model-free ones and ``early-exit:8``, the
    registry's draft model for a registry verifier (e.g. the default model's own int4 copy)
    and ``drafter:NAME`` (and ``drafter-tree:NAME`` for a feature drafter) for every named
    drafter trained for this verifier (the last two on the torch backend only).
    """

    def __init__(
        self,
        source,
        config: SinkWindowConfig | None = None,
        *,
        tokenizer=None,
        system: str | None = None,
        max_new_tokens: int = 128,
        keep_turns: int = 20,
        proposers: tuple[str, ...] | None = None,
        draft_lengths: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
        verifier_sha256: str | None = None,
    ):
        import ipywidgets as w

        if keep_turns < 1:
            raise ValueError(f"keep_turns must be >= 1, got {keep_turns}")
        self.chat = LiveChat(
            source,
            config,
            tokenizer=tokenizer,
            system=system,
            max_new_tokens=max_new_tokens,
            verifier_sha256=verifier_sha256,
        )
        if proposers is None:
            proposers = offered_proposer_specs(
                getattr(getattr(source, "description", None), "name", None),
                self.chat.verifier_sha256,
                registry.name_of(self.chat.store.model),
            )
        self.keep_turns = keep_turns
        self.message = MessageBox()
        self.message.add_class("kl-message")
        self.message.on_submit(lambda _: self._send_from_page())
        self.send_button = w.Button(description="Send", button_style="primary", icon="paper-plane")
        self.send_button.add_class("kl-send")
        self.stop_button = w.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.stop_button.add_class("kl-stop")
        self.reset_button = w.Button(description="New conversation", icon="refresh")
        self.reset_button.add_class("kl-reset")
        self.export_button = w.Button(description="Export", icon="download")
        self.export_button.add_class("kl-export")
        longest = max(len(spec) for spec in proposers)
        self.proposer = w.Dropdown(
            options=list(proposers),
            value=proposers[0],
            description="proposer",
            layout=w.Layout(width=f"{min(640, 110 + 8 * longest)}px"),
        )
        self.draft_length = w.Dropdown(
            options=list(draft_lengths),
            value=4 if 4 in draft_lengths else draft_lengths[0],
            description="draft length",
            layout=w.Layout(width="170px"),
            style={"description_width": "initial"},
        )
        self.temperature = w.BoundedFloatText(
            value=0.0,
            min=0.0,
            max=5.0,
            step=0.1,
            description="temperature",
            layout=w.Layout(width="170px"),
            style={"description_width": "initial"},
        )
        self.top_p = w.BoundedFloatText(
            value=1.0,
            min=0.01,
            max=1.0,
            step=0.05,
            description="top-p",
            layout=w.Layout(width="130px"),
            style={"description_width": "initial"},
        )
        self.seed = w.BoundedIntText(
            value=0,
            min=0,
            max=2**31 - 1,
            description="seed",
            layout=w.Layout(width="150px"),
            style={"description_width": "initial"},
        )
        self.cache_view = w.HTML(
            cache_strip_html(self.chat.cache_snapshot())
            if self.chat.replies
            else '<div class="kl-cache">cache: empty session</div>'
        )
        self.latency_view = w.HTML(sparkline_html([], []))
        self.legend = w.HTML(legend_html())
        self.status = w.HTML(status_html(None, False))
        self.export_view = w.HTML("")
        # newest first in a column-reverse box: the browser keeps it scrolled to the newest
        # text while it grows, and leaves it alone once the reader scrolls up
        self.transcript = w.VBox(
            layout=w.Layout(max_height="420px", overflow="auto", flex_flow="column-reverse")
        )
        self.transcript.add_class("kl-transcript")
        self._reply_view: w.HTML | None = None
        self._w = w
        self.send_button.on_click(lambda _: self._send_from_page())
        self.stop_button.on_click(lambda _: self.stop())
        self.reset_button.on_click(lambda _: self.reset())
        self.export_button.on_click(lambda _: self.show_export())
        self.proposer.observe(lambda _: self._set_busy(False), "value")
        self.temperature.observe(lambda _: self._set_busy(False), "value")
        controls = w.HBox(
            [self.message, self.send_button, self.stop_button],
            layout=w.Layout(align_items="center"),
        )
        self.message.layout = w.Layout(width="60%")
        options = w.HBox([self.proposer, self.draft_length])
        sampling = w.HBox([self.temperature, self.top_p, self.seed])
        actions = w.HBox([self.reset_button, self.export_button, self.export_view])
        self.widget = w.VBox(
            [
                options,
                sampling,
                self.cache_view,
                self.latency_view,
                self.legend,
                self.transcript,
                controls,
                self.status,
                actions,
            ]
        )
        self.widget.add_class("kl-chat-panel")
        self._set_busy(False)

    # -------------------------------------------------------------- actions
    def sampling(self) -> SamplingConfig:
        """The sampling the controls set: greedy at temperature 0 (top-p and seed unused),
        else temperature with top-p (below 1) and the seed. Raises ValueError for values
        the sampler refuses."""
        temperature = float(self.temperature.value)
        if temperature == 0:
            return SamplingConfig()
        top_p = float(self.top_p.value)
        return SamplingConfig(
            temperature=temperature,
            top_p=top_p if top_p < 1 else None,
            seed=int(self.seed.value),
        )

    def send(self, text: str | None = None) -> ReplyRecord | None:
        """Send ``text`` (default: the message box) and stream the reply; returns its record,
        or None (with a hint in the status line) when nothing can be sent: an empty
        message, a reply still streaming, or sampling values the sampler refuses."""
        text = self.message.value if text is None else text
        if self.chat.streaming:
            self.status.value = status_html(None, False, "a reply is streaming: Stop it first")
            return None
        if not text.strip():
            self.status.value = status_html(None, False, "type a message first")
            return None
        try:
            sampling = self.sampling()
        except ValueError as exc:
            self.status.value = status_html(None, False, str(exc))
            return None
        self.message.value = ""
        self.export_view.value = ""
        record = self.chat.send(
            text,
            proposer=self.proposer.value,
            draft_length=int(self.draft_length.value),
            sampling=sampling,
            on_token=self._on_token,
            on_done=self._on_done,
            on_loading=self._on_loading,
        )
        self._set_busy(True)
        self._add_turn(record)
        return record

    def stop(self) -> None:
        """Stop the streaming reply after the current token (or the proposer's load)."""
        self.chat.stop()

    def wait(self, timeout: float | None = None) -> ReplyRecord | None:
        """Block until the streaming reply has finished (scripted use in a notebook)."""
        return self.chat.wait(timeout)

    def reset(self) -> None:
        """A new conversation: a fresh session and an empty page (ignored while a reply
        streams; Stop it first)."""
        if self.chat.streaming:
            self.status.value = status_html(None, False, "a reply is streaming: Stop it first")
            return
        self.chat.reset()
        for old in self.transcript.children:
            old.close()
        self.transcript.children = ()
        self._reply_view = None
        self.export_view.value = ""
        self.cache_view.value = '<div class="kl-cache">cache: empty session</div>'
        self.latency_view.value = sparkline_html([], [])
        self.status.value = status_html(None, False)

    def show_export(self) -> None:
        """Offer the conversation as Markdown and JSON downloads (links in the panel)."""
        self.export_view.value = export_links_html(self.chat)

    def _send_from_page(self) -> None:
        self.send()

    def _set_busy(self, busy: bool) -> None:
        """Disable what must not change while a reply streams; draft length only with a
        proposer, top-p and seed only when sampling."""
        for control in (
            self.message,
            self.send_button,
            self.proposer,
            self.reset_button,
            self.export_button,
            self.temperature,
        ):
            control.disabled = busy
        self.stop_button.disabled = not busy
        self.draft_length.disabled = busy or self.proposer.value == "none"
        greedy = float(self.temperature.value or 0) == 0
        self.top_p.disabled = busy or greedy
        self.seed.disabled = busy or greedy

    # ---------------------------------------------------------------- views
    def transcript_html(self, last: int | None = None) -> str:
        """The last ``last`` turns (default ``keep_turns``) with the cache strip and the latency
        sparkline, as static HTML (what a committed notebook can show without a kernel)."""
        records = self.chat.replies[-(last or self.keep_turns) :]
        body = "".join(
            user_html(r) + reply_html(r, colour_kinds=r.proposer != "none") for r in records
        )
        snap = cache_strip_html(self.chat.cache_snapshot())
        legend = legend_html() if any(r.proposer != "none" for r in records) else ""
        return f'<div class="kl-chat-static">{snap}{self._sparkline()}{legend}{body}</div>'

    def _sparkline(self) -> str:
        finished = [r for r in self.chat.replies if r.finished]
        return sparkline_html(
            list(self.chat.token_latencies),
            self.chat.latency_by_turn(),
            latest=finished[-1] if finished else None,
        )

    def _add_turn(self, record: ReplyRecord) -> None:
        w = self._w
        self._reply_view = w.HTML(reply_html(record, colour_kinds=record.proposer != "none"))
        # newest first (see the transcript's column-reverse layout)
        children = [self._reply_view, w.HTML(user_html(record))] + list(self.transcript.children)
        keep = 2 * self.keep_turns
        for old in children[keep:]:
            old.close()  # bounded DOM: only the last keep_turns turns stay rendered
        self.transcript.children = children[:keep]
        self.status.value = status_html(record, busy=True)

    def _on_loading(self, record: ReplyRecord) -> None:
        self.status.value = status_html(record, busy=True)

    def _on_token(self, record: ReplyRecord) -> None:
        if self._reply_view is not None:
            self._reply_view.value = reply_html(record, colour_kinds=record.proposer != "none")
        self.cache_view.value = cache_strip_html(self.chat.cache_snapshot())
        self.status.value = status_html(record, busy=True)
        if len(record.token_ids) % 4 == 1:
            self.latency_view.value = self._sparkline()

    def _on_done(self, record: ReplyRecord) -> None:
        if self._reply_view is not None:
            self._reply_view.value = reply_html(record, colour_kinds=record.proposer != "none")
        self.cache_view.value = cache_strip_html(self.chat.cache_snapshot())
        self.latency_view.value = self._sparkline()
        self.status.value = status_html(record, busy=False)
        self._set_busy(False)

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (
            "ChatPanel: a live widget; run the notebook in JupyterLab (make lab) "
            "to chat with the session"
        )
        return bundle
