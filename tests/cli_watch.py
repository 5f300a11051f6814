"""``kakeya-lab`` as a user runs it (``python -m kakeya_lab.cli``), in a subprocess watched
by an exit hook that says whether a model was loaded: any transformers model class module
(``transformers.models.NAME.modeling_NAME``) imported, which only building a model does;
and whether torch was imported at all.

This is how the CLI tests show that a check ran *before* the model loaded, without timing
anything (a busy machine makes a command slower, not different).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "KAKEYA_MODEL_CLASSES="
TORCH_MARK = "KAKEYA_TORCH_IMPORTED="
# Runs the CLI as __main__; at exit prints MARK and the model class modules imported.
_WATCHED = (
    "import atexit, runpy, sys\n"
    "def _report():\n"
    "    found = sorted(m for m in sys.modules if m.startswith('transformers.models.')\n"
    "                   and m.rsplit('.', 1)[-1].startswith('modeling_'))\n"
    f"    print({MARK!r} + ','.join(found), flush=True)\n"
    f"    print({TORCH_MARK!r} + str('torch' in sys.modules), flush=True)\n"
    "atexit.register(_report)\n"
    "sys.argv[0] = 'kakeya-lab'\n"
    "runpy.run_module('kakeya_lab.cli', run_name='__main__', alter_sys=True)\n"
)


def run_watched(
    args: list[str], cwd: str | Path | None = None
) -> tuple[subprocess.CompletedProcess, list[str], bool]:
    """Run ``kakeya-lab ARGS`` to its end; return the process (its stdout without the
    hook's lines), the model class modules it imported (empty: no model was loaded) and
    whether it imported torch."""
    proc = subprocess.run(
        [sys.executable, "-c", _WATCHED, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
    )
    lines = proc.stdout.splitlines()
    marks = [ln for ln in lines if ln.startswith(MARK)]
    torch = [ln for ln in lines if ln.startswith(TORCH_MARK)]
    assert len(marks) == len(torch) == 1, f"the exit hook did not report: {proc.stdout[-500:]}"
    proc.stdout = "".join(ln + "\n" for ln in lines if not ln.startswith((MARK, TORCH_MARK)))
    loaded = [m for m in marks[0].removeprefix(MARK).split(",") if m]
    return proc, loaded, torch[0].removeprefix(TORCH_MARK) == "True"
