"""``make lab``, the README's third command, starts JupyterLab on this machine kind, where
everything runs as root (Jupyter refuses root without ``--allow-root``, which the Makefile
passes then). The server is bound to 127.0.0.1 on a free port with a random token, waited
for by readiness, and stopped by the test."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STARTUP_S = 600  # pip's check of the lab extras and JupyterLab's start, on a busy machine

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_lab_starts_jupyterlab_as_this_user(tmp_path):
    if not (REPO / ".venv" / "bin" / "jupyter").exists():
        pytest.skip("no .venv with JupyterLab here (make install / make test creates it)")
    port, token = _free_port(), secrets.token_hex(16)
    lab_args = (
        f"--no-browser --port={port} --IdentityProvider.token={token} "
        f"--ServerApp.runtime_dir={tmp_path} --LabApp.workspaces_dir={tmp_path}"
    )
    log = open(tmp_path / "make-lab.log", "w")
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "-C", str(REPO), "lab", f"LAB_ARGS={lab_args}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # make, pip and jupyter in one group, stopped together
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config")},
    )
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/api/status?token={token}", timeout=5
                ) as resp:
                    assert resp.status == 200
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(
                        f"make lab exited with {proc.returncode}:\n"
                        + (tmp_path / "make-lab.log").read_text()[-3000:]
                    )
                if time.monotonic() > deadline:
                    pytest.fail("make lab did not answer in time")
                time.sleep(0.5)
        assert proc.poll() is None  # serving, as root too
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
