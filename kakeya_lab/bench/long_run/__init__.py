"""Long-run session benchmark: cache arms side by side over the same chat turns.

One unit: :class:`LongRunSettings` (:mod:`.settings`, every setting validated once; the CLI,
notebooks 00 and 20, sweeps and the checkpoint's strict resume use it), :func:`run_long`
(in-process arms) and :func:`~kakeya_lab.bench.long_run.served.run_served` (served arms),
and :func:`save_long_run` (:mod:`.report`), the one writer of the run folder's report.

Arms (:mod:`.arms`, :func:`standard_arms`):

* ``sink_window`` — our session runtime with a sink-window cache;
* ``full_cache`` — the same runtime with a cache that never evicts (memory grows);
* ``reprefill`` — stateless, OpenAI-style: every turn re-prefills the whole conversation
  into a fresh cache, as an HTTP chat endpoint does (latency grows). It stops once a turn
  takes longer than ``reprefill_cap_s``, which is recorded;
* ``speculative`` — the ``sink_window`` runtime decoding speculatively with a proposer
  (greedy: its replies equal ``sink_window``'s turn by turn).

Each turn (:mod:`.turn`) appends only the new chat-templated user message (stateful arms)
and generates a greedy reply (EOS or ``max_new_tokens``). Arms alternate turn by turn, so
they share machine conditions (:mod:`.driver`). Per turn the recorder keeps append latency,
time to first token, generate latency, tokens generated, ``kv_live_bytes``, cache and
history length, process RSS and truncation (:class:`TurnRecord`). Quality probes
(:mod:`.probe`) keep a flat latency curve from being mistaken for a useful session: a fact
planted in the first turn is asked for every ``probe.every`` turns on a provisional block
that is rolled back, and EOS and repetition rates are recorded.

Turns can be paced in wall-clock time (``turn_spacing_s``) and the run limited in time
(``duration_s``), both settings. Results are checkpointed atomically every ``checkpoint_every`` turns
and every ``report_every_s`` seconds into ``out_dir`` (:mod:`.checkpoint`), each time with
a partial report; SIGTERM / SIGINT end the run after the turn under way with a final
partial report (``partial``, ``abort_reason``). :func:`run_long` resumes from the
checkpoint only with the same settings, and loses no completed turn. Summaries
(p50/p95, KV min/mean/max, bucket tables by turns and by wall time, both verdicts):
:mod:`.summary` and :mod:`kakeya_lab.bench.aggregate`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run.arms import Arm, standard_arms
    from kakeya_lab.bench.long_run.checkpoint import ArmState, run_settings
    from kakeya_lab.bench.long_run.driver import LongRun, StoppedBeforeStart, run_long
    from kakeya_lab.bench.long_run.probe import FactProbe, probe_recall
    from kakeya_lab.bench.long_run.records import (
        DegenerateRun,
        TurnRecord,
        refuse_all_failed,
        refuse_degenerate,
    )
    from kakeya_lab.bench.long_run.report import save_long_run, save_quickstart
    from kakeya_lab.bench.long_run.settings import ARM_NAMES, CHECKPOINT, LongRunSettings
    from kakeya_lab.bench.long_run.summary import long_run_headline, summarize_long_run

# Imported on first use (PEP 562): ``kakeya_lab.bench.long_run.command`` (the CLI) must
# not pay for torch before its arguments are checked.
_LAZY = {
    "ARM_NAMES": "settings",
    "LongRunSettings": "settings",
    "save_long_run": "report",
    "save_quickstart": "report",
    "Arm": "arms",
    "standard_arms": "arms",
    "CHECKPOINT": "settings",
    "ArmState": "checkpoint",
    "run_settings": "checkpoint",
    "LongRun": "driver",
    "run_long": "driver",
    "StoppedBeforeStart": "driver",
    "FactProbe": "probe",
    "probe_recall": "probe",
    "DegenerateRun": "records",
    "TurnRecord": "records",
    "refuse_all_failed": "records",
    "refuse_degenerate": "records",
    "long_run_headline": "summary",
    "summarize_long_run": "summary",
}

__all__ = [
    "ARM_NAMES",
    "Arm",
    "ArmState",
    "CHECKPOINT",
    "DegenerateRun",
    "FactProbe",
    "LongRun",
    "LongRunSettings",
    "StoppedBeforeStart",
    "TurnRecord",
    "long_run_headline",
    "probe_recall",
    "refuse_all_failed",
    "refuse_degenerate",
    "run_long",
    "run_settings",
    "save_long_run",
    "save_quickstart",
    "standard_arms",
    "summarize_long_run",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
