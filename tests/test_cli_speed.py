"""``kakeya-lab --help``, every command's ``--help`` and an argument error of every command
cost next to nothing: under 1 s of CPU in a fresh interpreter, and torch is never imported.

Each case runs in its own subprocess (a small driver that calls ``kakeya_lab.cli.main``
and then says whether torch was imported); the child's user + system CPU time comes from
``os.wait4``. Before the CLI was split, every case imported torch and transformers (about
4 s of CPU), so each would fail both checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_LIMIT_S = 1.0

_DRIVER = """
import sys
from kakeya_lab.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""

# (argv, expected exit status); {tmp} is a scratch folder
CASES = [
    ([], 2),
    (["--help"], 0),
    (["frobnicate"], 2),
    (["models", "--help"], 0),
    (["models", "pull", "--help"], 0),
    (["models", "verify", "--help"], 0),
    (["models", "pull"], 2),
    (["chat", "--help"], 0),
    (["chat", "--temperature", "-1"], 2),
    (["run", "--help"], 0),
    (["run"], 2),
    (["sweep", "--help"], 0),
    (["sweep", "a.yaml", "--executor", "slurm"], 2),
    (["long-run", "--help"], 0),
    (["long-run", "{tmp}/out", "--turns", "0"], 2),
    (["long-run", "{tmp}/out", "--backend", "mlx", "--linear", "onednn"], 2),
    (["align", "--help"], 0),
    (["align", "capture", "--help"], 0),
    (["align", "train", "--help"], 0),
    (["align", "capture", "{tmp}/out", "--conversations", "0"], 2),
    (["align", "train", "mine", "--steps", "0"], 2),
    (["evidence", "--help"], 0),
    (["evidence", "check", "{tmp}"], 2),
    (["serve", "--help"], 0),
    (["serve", "--grpc-port", "70000"], 2),
]


def _cpu_of(argv: list[str], cwd: Path, driver: str = _DRIVER) -> tuple[int, float, str]:
    """Run ``driver`` with ``argv``; its exit status, CPU seconds (user + system), stderr."""
    err = cwd / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", driver, *argv],
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime, err.read_text()


@pytest.mark.parametrize("argv,code", CASES, ids=[" ".join(a) or "(none)" for a, _ in CASES])
def test_help_and_argument_errors_are_cheap(argv, code, tmp_path):
    args = [a.format(tmp=tmp_path) for a in argv]
    returncode, cpu_s, stderr = _cpu_of(args, tmp_path)
    assert returncode == code, stderr
    assert "torch imported: False" in stderr, stderr
    assert cpu_s < CPU_LIMIT_S, f"{argv}: {cpu_s:.2f} s of CPU"


def test_the_check_can_fail(tmp_path):
    """The control: ``--help`` after importing what the old single-module CLI imported
    first (torch and transformers) fails both checks."""
    eager = "import torch, transformers\n" + _DRIVER
    returncode, cpu_s, stderr = _cpu_of(["--help"], tmp_path, eager)
    assert returncode == 0, stderr
    assert "torch imported: True" in stderr, stderr
    assert cpu_s > CPU_LIMIT_S, cpu_s
