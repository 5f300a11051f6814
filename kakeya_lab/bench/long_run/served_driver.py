"""The durable served long run: the in-process run's machinery (:mod:`.driver`'s signal
handling and pacing, :mod:`.checkpoint`'s atomic checkpoint, :mod:`.identity`'s strict
resume check, :mod:`.report`'s writer) around turns driven through a running server.

* Every ``checkpoint_every`` rounds and every ``report_every_s`` seconds the run writes its
  checkpoint and calls ``on_report`` with a partial :class:`ServedRun`; SIGTERM / SIGINT
  end it after the turn under way with a final partial report (``abort_reason``: the
  signal's name).
* A failing turn is a row with an ``error`` (the server's one-line message), counted, not
  fatal; past ``max_errors`` failed turns the run stops (``abort_reason`` ``max_errors``).
* The turn script is cycled while ``duration_s`` lasts.
* A server that goes away (gRPC ``UNAVAILABLE`` / ``NOT_FOUND``, a refused connection) is
  waited for (``restart_wait_s``); the arm's session is then re-created and the turn run
  again, its row marked ``server_restart`` with the next ``session_epoch``.

Resume (and every re-creation of a session) is exact by re-sending the recorded history
before the next turn — a resume marker in ``events``, not a measured turn:
``grpc_session`` opens a new session and appends the token ids the old one held (the
client mirrors them turn by turn) and then goes on in token mode, its user messages
rendered by the client's copy of the chat template (the same ids the server's template
gives); the HTTP arms re-send their recorded conversation anyway, so their state is the
message list. An ``http_reuse`` turn that finds its server-side session gone re-prefills
the whole conversation inside the request: that row is marked ``measured`` False and left
out of the aggregates.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from kakeya_lab.bench.long_run.checkpoint import start_over
from kakeya_lab.bench.long_run.driver import NoSignals, StoppedBeforeStart, StopSignals, wait_until
from kakeya_lab.bench.long_run.identity import check_checkpoint
from kakeya_lab.bench.long_run.served_report import ServedRun, summarize_served
from kakeya_lab.bench.long_run.served_turns import (
    error_text,
    grpc_turn,
    http_turn,
    is_server_gone,
    server_rss,
)
from kakeya_lab.bench.long_run.settings import CHECKPOINT, LongRunSettings
from kakeya_lab.durable import write_json_atomic

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run.served import Endpoints

MAX_ERRORS = "max_errors"
# tokens per append when a gRPC session is re-created from its recorded history: under a
# server's default --max-append-tokens (8192), which a multi-hour history passes
RESEND_CHUNK = 4096


def served_settings(
    model: Mapping[str, Any],
    settings: LongRunSettings,
    user_turns: Sequence[str],
    *,
    served_model: str,
    cache: Mapping[str, int],
) -> dict[str, Any]:
    """Everything that shapes a served run's numbers, as its checkpoint saves it and a
    resume compares it: the model (``model``: name and weight hash) and the name the server
    serves, the server's cache, the arms, the proposer, generation settings, pacing and the
    turn script (not the endpoints, ``duration_s``, ``max_errors`` or the report cadence)."""
    script = hashlib.sha256(json.dumps(list(user_turns)).encode()).hexdigest()
    saved: dict[str, Any] = {
        # "backend": the server runs the model (and says how); also keeps the in-process
        # reading of a checkpoint without a backend (a torch run on aten) away from it
        "model": {**dict(model), "backend": "served"},
        "served_model": served_model,
        "server_cache": dict(cache),
        "served_arms": list(settings.served_arms),
        "proposer": (
            {"spec": settings.served_proposer, "draft_length": settings.draft_length}
            if settings.served_proposer is not None
            else None
        ),
        "max_new_tokens": settings.max_new_tokens,
        "turns": {"count": len(user_turns), "sha256": script},
        "reprefill_cap_s": settings.reprefill_cap_s,
        "turns_per_bucket": settings.turns_per_bucket,
    }
    if settings.turn_spacing_s is not None:
        saved["turn_spacing_s"] = settings.turn_spacing_s
    return json.loads(json.dumps(saved))


@dataclass
class ServedArmState:
    """One served arm during a run. ``chat``: the gRPC arm's mirror of its conversation
    (a :class:`~kakeya_lab.chat.ChatTemplate`), ``history_ids`` the ids its session holds;
    ``messages``: an HTTP arm's conversation. ``recreate``: why the session must be
    (re-)created before the next turn (``start``, ``resume``, ``server_restart``,
    ``after_error``)."""

    name: str
    chat: Any = None
    messages: list[dict] = field(default_factory=list)
    history_ids: list[int] = field(default_factory=list)
    history_len: int = 0
    stopped: str | None = None
    session_id: str | None = None
    epoch: int = 0
    token_mode: bool = False
    recreate: str | None = "start"
    resumed: bool = False
    restarted: bool = False  # the server restarted since this arm's last turn

    def to_doc(self) -> dict:
        chat = (
            self.chat.to_state()
            if self.chat is not None
            else {"messages": self.messages, "rendered": "", "awaiting_reply": False}
        )
        return {
            "history_ids": self.history_ids,
            "chat": chat,
            "stopped": self.stopped,
            "history_len": self.history_len,
            "session_epoch": self.epoch,
        }


@dataclass
class ServedProgress:
    """Where a served run is: its rows, next round, wall time, arms and events."""

    rows: list[dict]
    next_turn: int
    wall_s: float
    states: dict[str, ServedArmState]
    events: list[dict] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(1 for r in self.rows if r.get("error"))


def _fresh(arms: Sequence[str], tokenizer) -> ServedProgress:
    from kakeya_lab.chat import ChatTemplate

    states = {
        name: ServedArmState(name, chat=ChatTemplate(tokenizer) if name == "grpc_session" else None)
        for name in arms
    }
    return ServedProgress(rows=[], next_turn=0, wall_s=0.0, states=states)


def _load(path: Path, arms: Sequence[str], tokenizer, saved: dict) -> ServedProgress:
    from kakeya_lab.chat import ChatTemplate

    doc = check_checkpoint(path, saved)
    states = {}
    for name in arms:
        a = doc["arms"][name]
        grpc = name == "grpc_session"
        states[name] = ServedArmState(
            name,
            chat=ChatTemplate.from_state(tokenizer, a["chat"]) if grpc else None,
            messages=[] if grpc else list(a["chat"]["messages"]),
            history_ids=list(a["history_ids"]),
            history_len=int(a.get("history_len", len(a["history_ids"]))),
            stopped=a["stopped"],
            epoch=int(a.get("session_epoch", 0)),
            recreate="resume",
            resumed=True,
        )
    return ServedProgress(
        rows=doc["rows"],
        next_turn=doc["next_turn"],
        wall_s=doc["wall_s"],
        states=states,
        events=list(doc.get("events", [])),
    )


def _save(path: Path, progress: ServedProgress, saved: dict) -> None:
    write_json_atomic(
        path,
        {
            "kind": "served",
            "settings": saved,
            "next_turn": progress.next_turn,
            "wall_s": progress.wall_s,
            "plant_len": {},
            "rows": progress.rows,
            "events": progress.events,
            "arms": {n: s.to_doc() for n, s in progress.states.items()},
        },
    )


class _Clients:
    """The run's clients: one gRPC channel (replaced after an outage: a channel in
    reconnect backoff can take minutes to notice the server is back) and one OpenAI
    client."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self.grpc: Any = None
        self.openai: Any = None
        if endpoints.grpc_target is not None:
            self._connect()
        if endpoints.http_base is not None:
            import openai

            from kakeya_lab.serve.api_keys import client_key

            self.openai = openai.OpenAI(  # a keyed server's key from $KAKEYA_LAB_API_KEY
                base_url=f"{endpoints.http_base}/v1",
                api_key=client_key() or "unused",
                max_retries=0,
                timeout=600,
            )

    def _connect(self) -> None:
        from kakeya_lab.serve.client import SessionClient

        if self.grpc is not None:
            self.grpc.close()
        self.grpc = SessionClient(str(self.endpoints.grpc_target), timeout_s=600)

    def wait_for_server(self, timeout_s: float, signals) -> bool:
        """Poll the server until it answers on every endpoint given (True) or
        ``timeout_s`` passed or a signal was caught (False)."""
        import httpx

        from kakeya_lab.serve.api_keys import auth_headers

        deadline = time.perf_counter() + timeout_s
        while not signals.caught and time.perf_counter() < deadline:
            try:
                if self.endpoints.http_base is not None:
                    reply = httpx.get(
                        f"{self.endpoints.http_base}/health", timeout=5, headers=auth_headers()
                    )
                    if reply.status_code != 200:
                        raise RuntimeError(f"health {reply.status_code}")
                if self.endpoints.grpc_target is not None:
                    self._connect()
                    self.grpc.wait_ready(
                        timeout_s=min(5.0, max(0.1, deadline - time.perf_counter()))
                    )
                return True
            except Exception:  # not back yet
                wait_until(time.perf_counter() + 0.5, signals)
        return False

    def close(self) -> None:
        if self.grpc is not None:
            self.grpc.close()


class _Driver:
    """One served run's turns (see the module docstring)."""

    def __init__(
        self,
        endpoints: Endpoints,
        settings: LongRunSettings,
        turns: list[str],
        progress: ServedProgress,
        clients: _Clients,
        *,
        served_model: str,
        tokenizer,
        t0: float,
        signals,
        restart_wait_s: float,
    ) -> None:
        self.endpoints, self.settings, self.turns = endpoints, settings, turns
        self.progress, self.clients = progress, clients
        self.served_model, self.tokenizer = served_model, tokenizer
        self.t0, self.signals, self.restart_wait_s = t0, signals, restart_wait_s

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def event(self, kind: str, arm: str, turn: int, **more: Any) -> None:
        self.progress.events.append(
            {"kind": kind, "arm": arm, "turn": turn, "wall_s": self.wall(), **more}
        )

    def recreate(self, st: ServedArmState, turn: int) -> None:
        """Open the arm's session (again), re-sending its recorded history."""
        reason = st.recreate
        more: dict[str, Any] = {}
        if st.name == "grpc_session":
            client = self.clients.grpc
            if st.session_id is not None:
                try:
                    client.close_session(st.session_id)
                except Exception:  # gone with the old server, or half-used: either way closed
                    pass
                st.session_id = None
            sid = client.create()
            st.session_id = sid
            if st.history_ids:
                t = time.perf_counter()
                prefill_s, held = 0.0, 0
                # in pieces: a long run's history is more than a server takes in one append
                for start in range(0, len(st.history_ids), RESEND_CHUNK):
                    reply = client.append_ids(sid, st.history_ids[start : start + RESEND_CHUNK])
                    prefill_s += reply.latency_s
                    held = reply.history_len
                if held != len(st.history_ids):
                    raise RuntimeError(
                        f"the re-created session holds {held} tokens, "
                        f"not the {len(st.history_ids)} re-sent"
                    )
                st.token_mode = True
                more = {
                    "reprefill_tokens": len(st.history_ids),
                    "reprefill_s": prefill_s,
                    "request_s": time.perf_counter() - t,
                }
        else:
            more = {"reprefill_tokens": 0, "note": "the next request re-sends the conversation"}
        st.recreate = None
        if reason != "start":
            st.epoch += 1
            self.event(reason or "recreate", st.name, turn, session_epoch=st.epoch, **more)

    def turn(self, st: ServedArmState, text: str) -> dict:
        s = self.settings
        if st.name == "grpc_session":
            snapshot = st.chat.to_state()
            try:
                row, committed = grpc_turn(
                    self.clients.grpc,
                    str(st.session_id),
                    text,
                    s.max_new_tokens,
                    chat=st.chat,
                    token_mode=st.token_mode,
                    proposer=s.served_proposer,
                    draft_length=s.draft_length,
                )
            except BaseException:
                from kakeya_lab.chat import ChatTemplate

                st.chat = ChatTemplate.from_state(self.tokenizer, snapshot)
                raise
            st.history_ids.extend(committed)
            return row
        return http_turn(
            self.clients.openai,
            self.served_model,
            st.messages,
            text,
            s.max_new_tokens,
            reuse=st.name == "http_reuse",
            proposer=s.served_proposer,
            draft_length=s.draft_length,
        )

    def arm_turn(self, st: ServedArmState, text: str, i: int) -> dict:
        """Turn ``i`` of one arm: its row, or an error row (the failure counted)."""
        server_restart = st.restarted
        for attempt in (0, 1):
            try:
                if st.recreate is not None:
                    self.recreate(st, i)
                row = self.turn(st, text)
                break
            except Exception as exc:
                if st.name == "grpc_session":
                    st.recreate = "after_error"  # the session may hold half a turn
                if attempt == 0 and is_server_gone(exc) and not self.signals.caught:
                    self.event("server_gone", st.name, i, error=error_text(exc))
                    if self.clients.wait_for_server(self.restart_wait_s, self.signals):
                        # the server lost every arm's session, not only this one's
                        for other in self.progress.states.values():
                            if not other.stopped:
                                other.recreate, other.restarted = "server_restart", True
                        server_restart = True
                        continue
                    message = (
                        f"server gone ({error_text(exc)}) and not back within "
                        f"{self.restart_wait_s:g}s"
                    )
                else:
                    message = error_text(exc)
                return {
                    "arm": st.name,
                    "turn": i,
                    "error": message,
                    "wall_s": self.wall(),
                    "session_epoch": st.epoch,
                    "server_restart": server_restart,
                    "resumed": st.resumed,
                }
        prompt_len = row["history_len"] - row["generated_tokens"]
        cold = st.name == "http_reuse" and st.history_len > 0 and row["cached_tokens"] == 0
        row.update(
            arm=st.name,
            turn=i,
            user_tokens=prompt_len - st.history_len,
            wall_s=self.wall(),
            rss_bytes=server_rss(self.endpoints.http_base),
            session_epoch=st.epoch,
            server_restart=server_restart,
            resumed=st.resumed,
            measured=not cold,
        )
        st.history_len = row["history_len"]
        st.resumed = st.restarted = False
        return row

    def round(self, log: Callable[[str], None] | None) -> None:
        """Round ``next_turn`` for every arm still running, then advance."""
        p, s = self.progress, self.settings
        i = p.next_turn
        text = self.turns[i % len(self.turns)]
        done = []
        for name, st in p.states.items():
            if st.stopped:
                continue
            row = self.arm_turn(st, text, i)
            p.rows.append(row)
            done.append(row)
            if (
                name == "http_stateless"
                and not row.get("error")
                and s.reprefill_cap_s is not None
                and row["request_s"] > s.reprefill_cap_s
            ):
                st.stopped = (
                    f"stopped after turn {i}: a request took {row['request_s']:.1f}s > "
                    f"{s.reprefill_cap_s}s"
                )
                if log is not None:
                    log(f"http_stateless {st.stopped}")
        p.next_turn = i + 1
        if log is not None:
            log(
                f"turn {i}: "
                + "  ".join(
                    f"{r['arm']} error: {r['error']}"
                    if r.get("error")
                    else f"{r['arm']} {r['request_s']:.2f}s (prefill {r['append_latency_s']:.3f}s)"
                    for r in done
                )
            )

    def close(self, keep_http_sessions: bool) -> None:
        """Close the gRPC session (a resume re-creates it); delete ``http_reuse``'s
        server-side session at the end of a run (kept when a signal stopped it, so a prompt
        resume finds it)."""
        for st in self.progress.states.values():
            try:
                if st.name == "grpc_session" and st.session_id is not None:
                    self.clients.grpc.close_session(st.session_id)
                    st.session_id = None
                elif st.name == "http_reuse" and not keep_http_sessions:
                    last = [
                        r for r in self.progress.rows if r["arm"] == st.name and not r.get("error")
                    ]
                    if last and self.endpoints.http_base is not None:
                        import httpx

                        from kakeya_lab.serve.api_keys import auth_headers

                        httpx.delete(
                            f"{self.endpoints.http_base}/v1/sessions/{last[-1]['session_id']}",
                            timeout=30,
                            headers=auth_headers(),
                        )
            except Exception:  # the server may be gone: nothing left to close
                pass


def drive_served(
    endpoints: Endpoints,
    settings: LongRunSettings,
    turns: list[str],
    *,
    served_model: str,
    cache: dict,
    model_identity: Mapping[str, Any],
    tokenizer=None,
    out_dir: str | Path | None = None,
    on_report: Callable[[ServedRun], None] | None = None,
    catch_signals: bool = True,
    force_new: bool = False,
    on_start: Callable[[], None] | None = None,
    log: Callable[[str], None] | None = None,
    restart_wait_s: float = 120.0,
) -> ServedRun:
    """The rounds of a served run (:func:`~kakeya_lab.bench.long_run.served.run_served`
    checks the arguments and reads the server first). ``tokenizer``: the model's, for the
    gRPC arm's mirror. With ``out_dir`` the run checkpoints there (``checkpoint.json``)
    and resumes from it (:class:`~kakeya_lab.resume.ResumeMismatch` /
    :class:`~kakeya_lab.resume.DamagedCheckpoint` before anything is sent; ``force_new``
    starts over). A signal before the first round raises
    :class:`~kakeya_lab.bench.long_run.StoppedBeforeStart` with nothing written."""
    arms = list(settings.served_arms)
    saved = served_settings(model_identity, settings, turns, served_model=served_model, cache=cache)
    out = Path(out_dir) if out_dir is not None else None
    checkpoint = out / CHECKPOINT if out is not None else None

    def build(wall_s: float, partial: bool, reason: str | None, detail: str | None) -> ServedRun:
        table = pd.DataFrame(progress.rows)
        for column in ("arm", "turn", "error"):
            if column not in table:
                table[column] = pd.Series(dtype=object)
        summary = summarize_served(
            table,
            cache,
            turns_per_bucket=settings.turns_per_bucket,
            seconds_per_bucket=settings.seconds_per_bucket,
            prefill_tolerance=settings.prefill_tolerance,
            prefill_direction=settings.prefill_direction,
        )
        for name, st in progress.states.items():
            if name in summary:
                summary[name]["stopped"] = st.stopped
        return ServedRun(
            turns=table,
            summary=summary,
            cache=cache,
            model=served_model,
            endpoints=endpoints,
            partial=partial,
            abort_reason=reason,
            abort_detail=detail,
            duration_s=wall_s,
            events=list(progress.events),
        )

    def report(
        wall_s: float, partial: bool, reason: str | None = None, detail: str | None = None
    ) -> ServedRun:
        progress.wall_s = wall_s
        if checkpoint is not None:
            _save(checkpoint, progress, saved)
        run = build(wall_s, partial, reason, detail)
        if on_report is not None and progress.rows:
            on_report(run)
        return run

    with StopSignals() if catch_signals else NoSignals() as signals:
        try:
            if checkpoint is not None and checkpoint.exists() and not force_new:
                progress = _load(checkpoint, arms, tokenizer, saved)
            else:
                if out is not None and force_new:
                    start_over(out)
                progress = _fresh(arms, tokenizer)
        except KeyboardInterrupt:
            raise StoppedBeforeStart("SIGINT") from None
        if signals.caught:
            raise StoppedBeforeStart(signals.caught)
        clients = _Clients(endpoints)
        t0 = time.perf_counter() - progress.wall_s
        driver = _Driver(
            endpoints,
            settings,
            turns,
            progress,
            clients,
            served_model=served_model,
            tokenizer=tokenizer,
            t0=t0,
            signals=signals,
            restart_wait_s=restart_wait_s,
        )
        if on_start is not None:
            on_start()
        limit = len(turns) if settings.duration_s is None else None
        last_report = time.perf_counter()
        detail: str | None = None
        try:
            while (limit is None or progress.next_turn < limit) and not signals.caught:
                if settings.turn_spacing_s is not None:
                    wait_until(t0 + progress.next_turn * settings.turn_spacing_s, signals)
                    if signals.caught:
                        break
                if settings.duration_s is not None and driver.wall() >= settings.duration_s:
                    break
                if all(st.stopped for st in progress.states.values()):
                    break
                driver.round(log)
                if progress.errors > settings.max_errors:
                    last = next(r["error"] for r in reversed(progress.rows) if r.get("error"))
                    detail = (
                        f"{progress.errors} failed turns, more than max_errors "
                        f"{settings.max_errors}; the last: {last}"
                    )
                    break
                now = time.perf_counter()
                due = (
                    settings.report_every_s is not None
                    and now - last_report >= settings.report_every_s
                )
                if progress.next_turn % settings.checkpoint_every == 0 or due:
                    report(driver.wall(), partial=True)
                    last_report = now  # by wall time: the report's own writing counts
        finally:
            reason = signals.caught or (MAX_ERRORS if detail is not None else None)
            driver.close(keep_http_sessions=signals.caught is not None)
            clients.close()
        final = report(driver.wall(), partial=reason is not None, reason=reason, detail=detail)
    return final
