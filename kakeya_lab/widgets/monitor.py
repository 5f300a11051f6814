"""Live monitors: watch a running long run's folder, or a server's ``/metrics``, from a
notebook while it runs.

A long run rewrites ``turns.csv`` and ``metrics.json`` (partial until the end) at every
checkpoint; :func:`read_run_folder` reads what is there now (a file caught mid-replace is
read at the next refresh). :class:`RunMonitor` redraws :func:`~kakeya_lab.plots.run_monitor_figure`
— KV bytes against the budget, turn latency p50/p95 per bucket, prefill against history,
failed turns — whenever the folder changes, from a background thread, so the kernel stays
free; it stops by itself when the run has ended. :class:`ServerMonitor` samples a server's
Prometheus ``/metrics`` the same way (:func:`server_samples`). Both have :meth:`refresh`
for one synchronous update (scripts, tests) and :meth:`start` / :meth:`stop`.
"""

from __future__ import annotations

import html
import json
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kakeya_lab.bench.long_run.settings import CHECKPOINT


@dataclass(frozen=True)
class RunFolderState:
    """What a long run's folder holds now: its turn rows, the analytic KV budget (from a
    report; None before the first), and ``status``: ``waiting`` (nothing written yet),
    ``running`` (a checkpoint or a partial report) or ``ended`` (a final report)."""

    turns: pd.DataFrame
    budget_bytes: int | None
    status: str
    planned_turns: int | None
    abort_reason: str | None = None

    @property
    def turns_done(self) -> int:
        return int(self.turns["turn"].max()) + 1 if len(self.turns) else 0

    @property
    def failed_turns(self) -> int:
        if not len(self.turns) or "error" not in self.turns:
            return 0
        errors = self.turns["error"]
        return int((errors.notna() & (errors.astype(str) != "")).sum())


def read_run_folder(run_dir: str | Path) -> RunFolderState:
    """The state of the long run writing into ``run_dir`` (see :class:`RunFolderState`).
    Raises FileNotFoundError when ``run_dir`` is not a directory, ValueError when a file
    there cannot be read as a run's (a file being replaced reads whole: the run writes
    atomically)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"no run folder at {folder}")
    metrics = _json(folder / "metrics.json")
    checkpoint = _json(folder / CHECKPOINT)
    if (folder / "turns.csv").exists():
        turns = pd.read_csv(folder / "turns.csv")
    elif checkpoint is not None:
        turns = pd.DataFrame(checkpoint.get("rows") or [])
    else:
        turns = pd.DataFrame()
    if len(turns) and not {"arm", "turn", "kv_live_bytes"} <= set(turns.columns):
        raise ValueError(f"{folder}: turns.csv has no arm/turn/kv_live_bytes columns")
    budget = None
    status = "waiting"
    abort_reason = None
    if metrics is not None:
        arms = (metrics.get("metrics") or {}).get("arms") or {}
        budgets = [a.get("budget_bytes") for a in arms.values() if a.get("budget_bytes")]
        budget = int(budgets[0]) if budgets else None
        partial = (metrics.get("metrics") or {}).get("partial", False)
        status = "running" if partial else "ended"
        abort_reason = (metrics.get("metrics") or {}).get("abort_reason")
    elif checkpoint is not None or len(turns):
        status = "running"
    planned = metrics.get("turns") if metrics is not None else None
    if planned is None and checkpoint is not None:
        planned = (checkpoint.get("settings") or {}).get("turns")
    return RunFolderState(turns, budget, status, planned, abort_reason)


def _json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no JSON object")
    return data


def server_samples(text: str, previous: dict | None, elapsed_s: float) -> dict[str, float]:
    """One sample of a server's Prometheus exposition ``text`` at ``elapsed_s``: open
    sessions, KV bytes held, generated tokens and failed requests (totals), and tokens/s
    since ``previous`` (the last sample; 0 for the first)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {"generated_total": 0.0, "errors_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kakeya_sessions_open":
                values["sessions_open"] = sample.value
            elif sample.name == "kakeya_kv_live_bytes":
                values["kv_live_bytes"] = sample.value
            elif sample.name == "kakeya_generated_tokens_total":
                values["generated_total"] += sample.value
            elif sample.name == "kakeya_request_errors_total":
                values["errors_total"] += sample.value
    if "sessions_open" not in values or "kv_live_bytes" not in values:
        raise ValueError("not a kakeya-lab server's /metrics (no kakeya_sessions_open)")
    rate = 0.0
    if previous is not None and elapsed_s > previous["elapsed_s"]:
        rate = (values["generated_total"] - previous["generated_total"]) / (
            elapsed_s - previous["elapsed_s"]
        )
    return {**values, "elapsed_s": elapsed_s, "tokens_per_s": rate}


class _Poller:
    """A daemon thread calling ``refresh`` every ``every_s`` seconds until stopped or
    ``refresh`` says the watched thing has ended."""

    def __init__(self, every_s: float):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Refresh in the background (no-op if already running)."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10) -> None:
        """Stop refreshing (waits up to ``timeout`` for the refresh in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.refresh():
                return
            self._stop.wait(self.every_s)

    def refresh(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError


class RunMonitor(_Poller):
    """Follows the long run writing into ``run_dir``: a figure
    (:func:`~kakeya_lab.plots.run_monitor_figure`, turn latency in buckets of
    ``bucket_turns``) and a status line, redrawn when the folder changes, every
    ``every_s`` seconds on a background thread started by :meth:`start` (it stops by
    itself once the run has ended). Display it in a notebook cell."""

    def __init__(self, run_dir: str | Path, *, every_s: float = 5.0, bucket_turns: int = 10):
        import ipywidgets as w

        super().__init__(every_s)
        if isinstance(bucket_turns, bool) or not isinstance(bucket_turns, int) or bucket_turns < 1:
            raise ValueError(f"bucket_turns must be an integer >= 1, got {bucket_turns!r}")
        self.run_dir = Path(run_dir)
        self.bucket_turns = bucket_turns
        self.state: RunFolderState | None = None
        self.refreshes = 0
        self._seen: tuple | None = None
        self.status = w.HTML(_status(f"watching {self.run_dir.name}: nothing read yet", "waiting"))
        self.figure = w.Output()
        self.widget = w.VBox([self.status, self.figure])
        self.widget.add_class("kl-monitor")

    def refresh(self) -> bool:
        """Read the folder; redraw if it changed. Returns True once the run has ended (the
        background loop then stops). A folder that cannot be read is reported in the
        status line, not raised (the next refresh tries again)."""
        from kakeya_lab.plots import run_monitor_figure

        self.refreshes += 1
        try:
            seen = tuple(
                (p.name, p.stat().st_mtime_ns, p.stat().st_size)
                for p in sorted(self.run_dir.glob("*"))
                if p.name in ("turns.csv", "metrics.json", CHECKPOINT)
            )
            if seen == self._seen and self.state is not None:
                return self.state.status == "ended"
            state = read_run_folder(self.run_dir)
        except (OSError, ValueError, pd.errors.ParserError) as exc:
            self.status.value = _status(f"{self.run_dir.name}: {exc}", "error")
            return False
        self._seen, self.state = seen, state
        if len(state.turns):
            fig = run_monitor_figure(
                state.turns,
                state.budget_bytes,
                self.bucket_turns,
                title=f"{self.run_dir.name}: {state.turns_done} turns",
            )
            self.figure.outputs = (_plotly_output(fig),)
        of = f" of {state.planned_turns}" if state.planned_turns else ""
        ended = f" ({state.abort_reason})" if state.abort_reason else ""
        self.status.value = _status(
            f"{self.run_dir.name}: {state.status}{ended} · turn {state.turns_done}{of} · "
            f"{state.failed_turns} failed · updated {time.strftime('%H:%M:%S')}",
            state.status,
            turns=state.turns_done,
        )
        return state.status == "ended"

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (
            f"RunMonitor of {self.run_dir.name}: a live widget; run the notebook in JupyterLab"
        )
        return bundle


class ServerMonitor(_Poller):
    """Samples the server at ``http_base`` (its ``/metrics``; ``api_key`` sent as a Bearer
    token) every ``every_s`` seconds on a background thread and redraws
    :func:`~kakeya_lab.plots.server_monitor_figure` over the last ``keep`` samples. It runs
    until :meth:`stop`; a failed sample is shown in the status line and retried."""

    def __init__(
        self,
        http_base: str,
        *,
        every_s: float = 2.0,
        keep: int = 1800,
        api_key: str | None = None,
        timeout_s: float = 10.0,
    ):
        import ipywidgets as w

        super().__init__(every_s)
        self.url = http_base.rstrip("/") + "/metrics"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.keep = keep
        self.samples: list[dict[str, float]] = []
        self._t0 = time.monotonic()
        self.status = w.HTML(_status(f"watching {self.url}: nothing read yet", "waiting"))
        self.figure = w.Output()
        self.widget = w.VBox([self.status, self.figure])
        self.widget.add_class("kl-monitor")

    def refresh(self) -> bool:
        """Take one sample and redraw; never ends by itself (returns False)."""
        from kakeya_lab.plots import server_monitor_figure

        request = urllib.request.Request(self.url)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
            sample = server_samples(
                text, self.samples[-1] if self.samples else None, time.monotonic() - self._t0
            )
        except (OSError, ValueError) as exc:
            self.status.value = _status(f"{self.url}: {exc}", "error")
            return False
        self.samples = (self.samples + [sample])[-self.keep :]
        self.figure.outputs = (_plotly_output(server_monitor_figure(pd.DataFrame(self.samples))),)
        self.status.value = _status(
            f"{self.url}: {sample['sessions_open']:.0f} open sessions · "
            f"{sample['tokens_per_s']:.1f} tokens/s · {sample['errors_total']:.0f} failed requests "
            f"· updated {time.strftime('%H:%M:%S')}",
            "running",
            turns=len(self.samples),
        )
        return False


def _status(text: str, state: str, *, turns: int = 0) -> str:
    return (
        f'<div class="kl-monitor-status" data-state="{state}" data-count="{turns}">'
        f"{html.escape(text)}</div>"
    )


def _plotly_output(fig) -> dict:
    """``fig`` as a notebook display output (plotly's mime type: JupyterLab draws it)."""
    return {
        "output_type": "display_data",
        "data": {
            "application/vnd.plotly.v1+json": json.loads(fig.to_json()),
            "text/plain": f"<figure: {fig.layout.title.text}>",
        },
        "metadata": {},
    }
