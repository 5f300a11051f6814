"""``run.json``: what a run folder ran, with which parameters, and how it ended.

The one writer of ``run.json`` for every run folder, whether a notebook made it
(:func:`~kakeya_lab.experiments.runner.run_notebook`: ``notebook`` and ``notebook_sha256``
set) or a CLI command (``kakeya-lab long-run``: ``command``, the argv that made it).
Fields: ``notebook``, ``notebook_sha256``, ``command``, ``experiment``, ``run_id``,
``parameters``, ``status``, ``started``, ``ended``, ``error``, ``progress`` (what the last
report said) and ``resumed`` (start times of later invocations that continued the run),
so :func:`~kakeya_lab.experiments.index.build_index` lists every run the same way.

``status`` is one of :data:`STATUSES`: ``running`` while the run goes on (kept current by
every partial report), ``partial`` when a signal stopped it (run the same command to
resume), ``completed``, ``failed`` (``error`` says why).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kakeya_lab.durable import write_json_atomic
from kakeya_lab.results import now_iso

RUN_RECORD = "run.json"
STATUSES = ("running", "partial", "completed", "failed")


class RunRecord:
    """The ``run.json`` of one run folder, rewritten atomically on every change.

    :meth:`start` keeps the first ``started`` of a folder that already holds a record of
    the same experiment (a resumed CLI run) and appends the new start to ``resumed``
    (``resume=False``: a fresh record, as for a notebook run).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        experiment: str,
        parameters: dict[str, Any],
        command: list[str] | None = None,
        notebook: str | None = None,
        notebook_sha256: str | None = None,
        run_id: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RUN_RECORD
        self.record: dict[str, Any] = {
            "notebook": notebook,
            "notebook_sha256": notebook_sha256,
            "command": None if command is None else [str(a) for a in command],
            "experiment": experiment,
            "run_id": run_id or self.run_dir.resolve().name,
            "parameters": json.loads(json.dumps(parameters, default=str)),
            "status": "running",
            "started": None,
            "ended": None,
            "error": None,
            "progress": {},
            "resumed": [],
        }

    def start(self, *, resume: bool = True) -> None:
        """Mark the run ``running`` (with ``resume``, a resumed run keeps its first start time)."""
        now = now_iso()
        previous = _read(self.path)
        if (
            resume
            and previous is not None
            and previous.get("experiment") == self.record["experiment"]
        ):
            self.record["started"] = previous.get("started") or now
            self.record["resumed"] = [*(previous.get("resumed") or []), now]
            self.record["progress"] = previous.get("progress") or {}
        else:
            self.record["started"] = now
        self._set(status="running", ended=None, error=None)

    def progress(self, **fields: Any) -> None:
        """Record the latest report (e.g. ``turns``, ``duration_s``); status stays ``running``."""
        self.record["progress"] = {**fields, "updated": now_iso()}
        self._set(status="running")

    def finish(
        self,
        status: str,
        error: str | None = None,
        error_type: str = "RunFailed",
        traceback: str | None = None,
    ) -> None:
        """End the record with ``status`` (``completed``, ``partial`` or ``failed``); ``error``
        says why a run failed or stopped (``traceback``: where, when known)."""
        if status not in STATUSES or status == "running":
            raise ValueError(f"finish: status must be completed, partial or failed, got {status!r}")
        self._set(
            status=status,
            ended=now_iso(),
            error=None
            if error is None
            else {"type": error_type, "message": error, "traceback": traceback},
        )

    def _set(self, **fields: Any) -> None:
        self.record.update(fields)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.record)


def _read(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None
