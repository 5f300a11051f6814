"""The race: one message answered by plain decoding and by a proposer, side by side, live.

:class:`Race` holds two sessions of one model with the same history. :meth:`Race.send`
appends the same user message to both and streams both replies (greedy, so a lossless
proposer gives the same tokens). One worker thread drives both streams and always advances
the lane that has used less of its *own* time (the time spent inside its stream): each
lane's clock runs only while it computes, as if it had the machine to itself, so neither
slows the other, the faster lane pulls ahead in tokens as it would on its own, and
``tokens/s`` are each lane's own. The speedup so far is the proposer lane's tokens/s over
the plain lane's, the same ratio the speculative benchmarks report (measured side by side
in one run). :class:`RaceView` is its ipywidgets view: two lanes, tokens appearing live,
and a line with tokens/s, acceptance and the speedup so far.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.thread_pool import release_thread_pool
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.proposers import check_proposer_spec, make_proposer
from kakeya_lab.session import (
    Done,
    SessionStore,
    SpeculativeStep,
    StreamingDetokenizer,
    Token,
    chat_turn,
)
from kakeya_lab.widgets.live_chat import STOPPED_BY_USER, plural


@dataclass
class Lane:
    """One lane's reply to the current message: its tokens, its own compute time, and
    (with a proposer) the drafts proposed and accepted."""

    name: str
    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    draft_flags: list[bool] = field(default_factory=list)  # per token: an accepted draft
    seconds: float = 0.0  # time spent inside this lane's stream
    proposed: int = 0
    accepted: int = 0
    stop_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    @property
    def tokens_per_s(self) -> float | None:
        return len(self.token_ids) / self.seconds if self.seconds > 0 and self.token_ids else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class RaceTurn:
    """The two lanes' replies to one message; ``error`` if the race failed."""

    message: str
    plain: Lane
    speculative: Lane
    loading: bool = False
    error: str | None = None
    finished: bool = False

    @property
    def speedup(self) -> float | None:
        """The proposer lane's tokens/s over the plain lane's (None before both have any)."""
        a, b = self.plain.tokens_per_s, self.speculative.tokens_per_s
        return b / a if a and b else None


class Race:
    """Plain decoding against ``proposer`` on two sessions of ``source`` (a loaded model)
    over the sink-window cache ``config``; see the module docstring. Greedy decoding;
    ``max_new_tokens`` per reply. The proposer is built on the worker thread at the first
    :meth:`send` (a draft model loads then; ``turn.loading`` says so)."""

    def __init__(
        self,
        source,
        config: SinkWindowConfig,
        *,
        proposer: str,
        draft_length: int = 4,
        max_new_tokens: int = 128,
        system: str | None = None,
    ):
        if not check_proposer_spec(proposer):
            raise ValueError("a race needs a proposer (plain decoding is the other lane)")
        if isinstance(draft_length, bool) or not isinstance(draft_length, int) or draft_length < 1:
            raise ValueError(f"draft_length must be an integer >= 1, got {draft_length!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.source = source
        self.tokenizer = source.tokenizer
        self.store = SessionStore(source.model, config, capacity=2)
        self.proposer_spec = proposer
        self.draft_length = draft_length
        self.max_new_tokens = max_new_tokens
        self.sessions = (self.store.create(), self.store.create())
        self.chats = (
            ChatTemplate(self.tokenizer, system=system),
            ChatTemplate(self.tokenizer, system=system),
        )
        self.turns: list[RaceTurn] = []
        self._proposer = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.is_alive()

    def histories(self) -> tuple[list[int], list[int]]:
        """The token ids each session holds (plain, proposer)."""
        return tuple(  # type: ignore[return-value]
            list(self.store.verifier(s).history_token_ids) for s in self.sessions
        )

    def send(
        self,
        text: str,
        *,
        on_update: Callable[[RaceTurn], None] | None = None,
        on_done: Callable[[RaceTurn], None] | None = None,
    ) -> RaceTurn:
        """Race both lanes on ``text`` on a worker thread; returns the (growing) turn.
        ``on_update`` runs after every token of either lane, ``on_done`` once at the end."""
        if self.running:
            raise RuntimeError("a race is running: stop it or wait for it first")
        if not text or not text.strip():
            raise ValueError("empty message: type something to send")
        turn = RaceTurn(text, Lane("plain"), Lane(self.proposer_spec))
        self.turns.append(turn)
        self._stop.clear()
        self._worker = threading.Thread(
            target=self._run, args=(turn, on_update, on_done), name="race", daemon=True
        )
        release_thread_pool()  # the worker computes now (backends/thread_pool.py)
        self._worker.start()
        return turn

    def stop(self) -> None:
        """Stop both lanes after the step in progress (each session keeps what it showed)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> RaceTurn | None:
        """Wait for the race to end; the latest turn (None before any)."""
        if self._worker is not None:
            self._worker.join(timeout)
        return self.turns[-1] if self.turns else None

    def _run(self, turn: RaceTurn, on_update, on_done) -> None:
        streams = []
        try:
            if self._proposer is None:
                turn.loading = True
                if on_update is not None:
                    on_update(turn)
                self._proposer = make_proposer(
                    self.proposer_spec, self.store.model, self.store.config, self.tokenizer
                )
                turn.loading = False
            for session, chat, prop in zip(self.sessions, self.chats, (None, self._proposer)):
                options: dict = (
                    {"proposer": prop, "draft_length": self.draft_length} if prop else {}
                )
                streams.append(
                    chat_turn(
                        self.store, session, chat, turn.message, self.max_new_tokens, **options
                    )
                )
            lanes = (turn.plain, turn.speculative)
            detoks = [StreamingDetokenizer(self._decode) for _ in lanes]
            ahead = [0, 0]  # accepted drafts of the current step still to be delivered
            while not all(lane.done for lane in lanes):
                if self._stop.is_set():
                    for lane in lanes:
                        lane.stop_reason = lane.stop_reason or STOPPED_BY_USER
                    break
                # the lane that has used less of its own time moves next
                i = min((i for i in (0, 1) if not lanes[i].done), key=lambda i: lanes[i].seconds)
                lane = lanes[i]
                start = time.perf_counter()
                try:
                    event = next(streams[i])
                except StopIteration:
                    lane.stop_reason = lane.stop_reason or "end"
                    continue
                finally:
                    lane.seconds += time.perf_counter() - start
                if isinstance(event, SpeculativeStep):
                    lane.proposed += event.proposed
                    lane.accepted += event.accepted
                    ahead[i] = min(event.accepted, event.emitted)
                elif isinstance(event, Token):
                    lane.token_ids.append(event.id)
                    lane.draft_flags.append(ahead[i] > 0)
                    ahead[i] = max(0, ahead[i] - 1)
                    lane.pieces.append(detoks[i].add(event.id))
                    if on_update is not None:
                        on_update(turn)
                elif isinstance(event, Done):
                    lane.stop_reason = event.stop_reason
        except Exception as exc:  # shown in the view; the sessions keep what was delivered
            turn.error = f"{type(exc).__name__}: {exc}"
        finally:
            for stream in streams:
                stream.close()
            turn.loading = False
            turn.finished = True
            if on_done is not None:
                on_done(turn)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def lane_html(lane: Lane, *, colour: bool) -> str:
    """A lane's reply (accepted drafts green when ``colour``) and its figures."""
    spans = "".join(
        f'<span style="background:#c7e9c0">{html.escape(p)}</span>'
        if colour and flag
        else html.escape(p)
        for p, flag in zip(lane.pieces, lane.draft_flags)
    )
    rate = f"{lane.tokens_per_s:.1f} tokens/s" if lane.tokens_per_s else "– tokens/s"
    acceptance = f" · acceptance {lane.acceptance:.0%}" if lane.acceptance is not None else ""
    state = lane.stop_reason or "running"
    return (
        f'<div class="kl-lane" data-lane="{html.escape(lane.name)}" data-tokens="{len(lane.token_ids)}" '
        f'data-state="{html.escape(state)}">'
        f"<b>{html.escape(lane.name)}</b> · {plural(len(lane.token_ids), 'token')} · {rate}"
        f"{acceptance} · {html.escape(state)}"
        f'<div style="white-space:pre-wrap;border-left:3px solid #6baed6;padding:4px 8px;'
        f'min-height:3em">{spans}</div></div>'
    )


def race_status_html(turn: RaceTurn | None) -> str:
    """The speedup so far, or the loading / error / idle state."""
    if turn is None:
        return '<div class="kl-race-status" data-state="idle">type a message and press Race</div>'
    if turn.error:
        return (
            f'<div class="kl-race-status" data-state="error" style="color:#c00">'
            f"{html.escape(turn.error)}</div>"
        )
    if turn.loading:
        return (
            '<div class="kl-race-status" data-state="loading">loading '
            f"{html.escape(turn.speculative.name)} …</div>"
        )
    state = "done" if turn.finished else "running"
    speedup = f"speedup so far {turn.speedup:.2f}×" if turn.speedup else "speedup: –"
    same = ""
    if turn.finished:
        n = min(len(turn.plain.token_ids), len(turn.speculative.token_ids))
        equal = turn.plain.token_ids[:n] == turn.speculative.token_ids[:n]
        same = " · the same tokens in both lanes" if equal else " · the lanes differ"
    return (
        f'<div class="kl-race-status" data-state="{state}" '
        f'data-speedup="{turn.speedup or 0:.4f}">{speedup} (the proposer lane\'s tokens/s over '
        f"plain decoding's, each on its own time){same}</div>"
    )


class RaceView:
    """The race as an ipywidgets view: a message box (Enter races), Race and Stop, and the
    two lanes side by side. ``RaceView(load_model(...), SinkWindowConfig(...),
    proposer="suffix")``; the :class:`Race` is :attr:`race`."""

    def __init__(
        self,
        source,
        config: SinkWindowConfig,
        *,
        proposer: str,
        draft_length: int = 4,
        max_new_tokens: int = 128,
        system: str | None = None,
    ):
        import ipywidgets as w

        from kakeya_lab.widgets.message_box import MessageBox

        self.race = Race(
            source,
            config,
            proposer=proposer,
            draft_length=draft_length,
            max_new_tokens=max_new_tokens,
            system=system,
        )
        self.message = MessageBox(layout=w.Layout(width="60%"))
        self.message.on_submit(lambda _: self._send_from_page())
        self.go_button = w.Button(description="Race", button_style="primary", icon="flag-checkered")
        self.go_button.add_class("kl-race-go")
        self.stop_button = w.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.stop_button.add_class("kl-race-stop")
        self.go_button.on_click(lambda _: self._send_from_page())
        self.stop_button.on_click(lambda _: self.race.stop())
        self.lanes = (
            w.HTML(lane_html(Lane("plain"), colour=False)),
            w.HTML(lane_html(Lane(proposer), colour=True)),
        )
        for lane in self.lanes:
            lane.layout = w.Layout(width="50%")
        self.status = w.HTML(race_status_html(None))
        self.widget = w.VBox(
            [
                w.HBox(list(self.lanes)),
                self.status,
                w.HBox([self.message, self.go_button, self.stop_button]),
            ]
        )
        self.widget.add_class("kl-race")

    def send(self, text: str | None = None) -> RaceTurn | None:
        """Race on ``text`` (default: the message box); None with a hint when nothing can
        start (an empty message, a race still running)."""
        text = self.message.value if text is None else text
        if self.race.running or not text.strip():
            hint = (
                "a race is running: Stop it first" if self.race.running else "type a message first"
            )
            self.status.value = f'<div class="kl-race-status" data-state="hint">{hint}</div>'
            return None
        self.message.value = ""
        self.go_button.disabled = self.message.disabled = True
        self.stop_button.disabled = False
        return self.race.send(text, on_update=self._show, on_done=self._done)

    def wait(self, timeout: float | None = None) -> RaceTurn | None:
        """Block until the race has finished (scripted use in a notebook)."""
        return self.race.wait(timeout)

    def _send_from_page(self) -> None:
        self.send()

    def _show(self, turn: RaceTurn) -> None:
        self.lanes[0].value = lane_html(turn.plain, colour=False)
        self.lanes[1].value = lane_html(turn.speculative, colour=True)
        self.status.value = race_status_html(turn)

    def _done(self, turn: RaceTurn) -> None:
        self._show(turn)
        self.go_button.disabled = self.message.disabled = False
        self.stop_button.disabled = True

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = "RaceView: a live widget; run the notebook in JupyterLab (make lab)"
        return bundle
