"""The chat panel: talk to a session in a notebook (ipywidgets).

``ChatPanel(load_model(...), SinkWindowConfig(...))`` shows a message box with Send and
Stop, a proposer and draft-length selector, a live strip of the cache (sink / window /
evicted tokens, ``kv_live_bytes`` against the analytic budget), a per-token latency
sparkline over the conversation and the transcript. Replies stream token by token from a
background thread (:class:`~kakeya_lab.widgets.live_chat.LiveChat`), so Stop is handled
mid-reply. In speculative mode accepted draft tokens are green and the verifier's own
tokens orange. Only the last ``keep_turns`` turns stay in the page (bounded DOM), so the
panel stays responsive over hundreds of turns.

The HTML it renders is plain markup with stable class names (``kl-reply``, ``kl-cache``,
``kl-status``) so a browser test can read what is shown.
"""

from __future__ import annotations

import html

from kakeya_lab.backends import registry
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.widgets.live_chat import STOPPED_BY_USER, CacheSnapshot, LiveChat, ReplyRecord

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
        f'<div class="kl-user" style="white-space:pre-wrap;padding:4px 8px;background:#f0f0f0;'
        f'border-radius:4px;margin-top:6px"><b>you</b> {html.escape(record.user_text)}</div>'
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
    latencies: list[tuple[int, float]], by_turn: list[float], width: int = 600, height: int = 48
) -> str:
    """Per-token latency (ms) over the last tokens of the conversation, turn boundaries dashed;
    with the mean ms/token of the first and the latest finished reply."""
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
    drift = ""
    if len(by_turn) >= 2:
        first, last = 1e3 * by_turn[0], 1e3 * by_turn[-1]
        drift = f" · mean ms/token first reply {first:.1f} → latest {last:.1f} ({100 * (last - first) / first:+.0f}%)"
    elif by_turn:
        drift = f" · mean ms/token {1e3 * by_turn[0]:.1f}"
    return (
        f'<div class="kl-latency"><svg width="{width}" height="{height}" style="background:#fafafa">'
        f'{marks}<polyline fill="none" stroke="#3182bd" stroke-width="1" points="{points}"/></svg>'
        f'<div style="font-size:85%">per-token latency, last {len(ms)} tokens (top {top:.0f} ms)'
        f"{drift}</div></div>"
    )


def status_html(record: ReplyRecord | None, busy: bool) -> str:
    if record is None:
        return '<div class="kl-status" data-state="idle">type a message and press Send</div>'
    if busy:
        return (
            f'<div class="kl-status" data-state="streaming">turn {record.turn}: streaming, '
            f"{len(record.token_ids)} tokens</div>"
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
        f'data-undelivered="{record.undelivered_tokens}">turn {record.turn}: {len(record.token_ids)} tokens, '
        f"{stop}{spec} · {held}{error}</div>"
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
    verifier is a registry model, one was measured for it and its draft model is pulled."""
    from kakeya_lab.models import REGISTRY
    from kakeya_lab.models.store import folder_present, model_dir
    from kakeya_lab.proposers import draft_model_spec

    spec = REGISTRY[model_name].draft if model_name in REGISTRY else ""
    if not spec:
        return []
    draft_name = draft_model_spec(spec.partition(":")[2])[0]
    return [spec] if folder_present(model_dir(draft_name)) else []


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
        self.message = w.Text(placeholder="type a message", layout=w.Layout(width="60%"))
        self.message.add_class("kl-message")
        self.send_button = w.Button(description="Send", button_style="primary", icon="paper-plane")
        self.send_button.add_class("kl-send")
        self.stop_button = w.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.stop_button.add_class("kl-stop")
        self.proposer = w.Dropdown(
            options=list(proposers),
            value=proposers[0],
            description="proposer",
            layout=w.Layout(width="220px"),
        )
        self.draft_length = w.Dropdown(
            options=list(draft_lengths),
            value=4 if 4 in draft_lengths else draft_lengths[0],
            description="draft length",
            layout=w.Layout(width="170px"),
            style={"description_width": "initial"},
        )
        self.cache_view = w.HTML(
            cache_strip_html(self.chat.cache_snapshot())
            if self.chat.replies
            else '<div class="kl-cache">cache: empty session</div>'
        )
        self.latency_view = w.HTML(sparkline_html([], []))
        self.status = w.HTML(status_html(None, False))
        self.transcript = w.VBox(layout=w.Layout(max_height="420px", overflow="auto"))
        self._reply_view: w.HTML | None = None
        self._w = w
        self.send_button.on_click(lambda _: self.send())
        self.stop_button.on_click(lambda _: self.stop())
        controls = w.HBox([self.message, self.send_button, self.stop_button])
        options = w.HBox([self.proposer, self.draft_length])
        self.widget = w.VBox(
            [options, self.cache_view, self.latency_view, self.transcript, controls, self.status]
        )
        self.widget.add_class("kl-chat-panel")

    # -------------------------------------------------------------- actions
    def send(self, text: str | None = None) -> ReplyRecord | None:
        """Send ``text`` (default: the message box) and stream the reply; returns its record."""
        text = self.message.value if text is None else text
        if self.chat.streaming or not text.strip():
            return None
        self.message.value = ""
        self.send_button.disabled = True
        self.stop_button.disabled = False
        record = self.chat.send(
            text,
            proposer=self.proposer.value,
            draft_length=int(self.draft_length.value),
            on_token=self._on_token,
            on_done=self._on_done,
        )
        self._add_turn(record)
        return record

    def stop(self) -> None:
        """Stop the streaming reply after the current token."""
        self.chat.stop()

    def wait(self, timeout: float | None = None) -> ReplyRecord | None:
        """Block until the streaming reply has finished (scripted use in a notebook)."""
        return self.chat.wait(timeout)

    # ---------------------------------------------------------------- views
    def transcript_html(self, last: int | None = None) -> str:
        """The last ``last`` turns (default ``keep_turns``) with the cache strip and the latency
        sparkline, as static HTML (what a committed notebook can show without a kernel)."""
        records = self.chat.replies[-(last or self.keep_turns) :]
        body = "".join(
            user_html(r) + reply_html(r, colour_kinds=r.proposer != "none") for r in records
        )
        snap = cache_strip_html(self.chat.cache_snapshot())
        spark = sparkline_html(list(self.chat.token_latencies), self.chat.latency_by_turn())
        return f'<div class="kl-chat-static">{snap}{spark}{body}</div>'

    def _add_turn(self, record: ReplyRecord) -> None:
        w = self._w
        self._reply_view = w.HTML(reply_html(record, colour_kinds=record.proposer != "none"))
        children = list(self.transcript.children) + [w.HTML(user_html(record)), self._reply_view]
        keep = 2 * self.keep_turns
        for old in children[:-keep]:
            old.close()  # bounded DOM: only the last keep_turns turns stay rendered
        self.transcript.children = children[-keep:]
        self.status.value = status_html(record, busy=True)

    def _on_token(self, record: ReplyRecord) -> None:
        if self._reply_view is not None:
            self._reply_view.value = reply_html(record, colour_kinds=record.proposer != "none")
        self.cache_view.value = cache_strip_html(self.chat.cache_snapshot())
        self.status.value = status_html(record, busy=True)
        if len(record.token_ids) % 4 == 1:
            self.latency_view.value = sparkline_html(
                list(self.chat.token_latencies), self.chat.latency_by_turn()
            )

    def _on_done(self, record: ReplyRecord) -> None:
        if self._reply_view is not None:
            self._reply_view.value = reply_html(record, colour_kinds=record.proposer != "none")
        self.cache_view.value = cache_strip_html(self.chat.cache_snapshot())
        self.latency_view.value = sparkline_html(
            list(self.chat.token_latencies), self.chat.latency_by_turn()
        )
        self.status.value = status_html(record, busy=False)
        self.send_button.disabled = False
        self.stop_button.disabled = True

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (
            "ChatPanel: a live widget; run the notebook in JupyterLab (make lab) "
            "to chat with the session"
        )
        return bundle
