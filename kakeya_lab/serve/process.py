"""``kakeya-lab serve`` as a subprocess: started on free loopback ports, ready when it prints
its ready line, stopped with SIGTERM (then killed). Used by the tests and the benchmarks
that drive a real server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kakeya_lab.models import DEFAULT_MODEL

# the addresses in the line kakeya_lab.serve.server prints once it serves
READY = re.compile(r"gRPC ([\d.]+:\d+); HTTP (http://[\d.]+:\d+)/v1")


@dataclass
class ServerProcess:
    """A running server: its process, addresses, the stderr lines read so far and its
    ready line (what it loaded and how it serves)."""

    proc: subprocess.Popen
    grpc_target: str
    http_base: str
    stderr: list[str] = field(default_factory=list)
    ready: str = ""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then kill after ``timeout_s``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def start_server(
    *extra: str,
    model: str = DEFAULT_MODEL,
    timeout_s: float = 180.0,
    env: Mapping[str, str] | None = None,
    threads: int = 1,
) -> ServerProcess:
    """``kakeya-lab serve --model MODEL --grpc-port 0 --http-port 0 *extra`` (free loopback
    ports unless ``extra`` names them), ``threads`` torch threads, this package first on the path,
    in ``env`` (default: this process's environment); returns once the ready line is
    printed, or kills the process and raises RuntimeError (with the end of its stderr)
    after ``timeout_s``."""
    root = Path(__file__).resolve().parents[2]
    base = dict(os.environ if env is None else env)
    path = os.pathsep.join(p for p in (str(root), base.get("PYTHONPATH", "")) if p)
    env = {**base, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    ports = [] if "--grpc-port" in extra else ["--grpc-port", "0", "--http-port", "0"]
    cmd = [sys.executable, "-m", "kakeya_lab.cli", "serve", "--model", model, *ports, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True).start()
    found: list[re.Match] = []
    ready: list[str] = []

    def read_ready() -> None:
        for line in proc.stdout or []:
            if match := READY.search(line):
                found.append(match)
                ready.append(line.strip())
                break

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(timeout=timeout_s)
    if not found:
        how = (
            f"exited with {proc.poll()}"
            if proc.poll() is not None
            else f"not ready in {timeout_s}s"
        )
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"server {how}: {''.join(stderr)[-2000:]}")
    return ServerProcess(proc, found[0].group(1), found[0].group(2), stderr, ready[0])
