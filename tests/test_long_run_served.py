"""``kakeya-lab long-run --endpoint``: the served arms against a real running server, into
the same turns.csv / metrics.json; bad endpoints refused before anything is contacted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("grpc", reason="needs the serve extra")
pytest.importorskip("openai", reason="needs the serve extra")

from kakeya_lab.bench.long_run.served import parse_endpoints  # noqa: E402
from kakeya_lab.cli import main  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"gRPC ([\d.]+:\d+); HTTP (http://[\d.]+:\d+)/v1")
SINK, WINDOW = 4, 40


@pytest.fixture(scope="module")
def server():
    """A real ``kakeya-lab serve`` on free ports; always stopped (SIGTERM, then kill)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kakeya_lab.cli",
            "serve",
            "--model",
            DEFAULT_MODEL,
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--sink",
            str(SINK),
            "--window",
            str(WINDOW),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    found: list[re.Match] = []

    def read_ready() -> None:
        for line in proc.stdout:
            if match := READY.search(line):
                found.append(match)
                break

    reader = threading.Thread(target=read_ready, daemon=True)
    reader.start()
    reader.join(timeout=180)
    try:
        if not found:
            pytest.fail(f"server not ready: {''.join(stderr)[-2000:]}")
        yield f"grpc://{found[0].group(1)}", found[0].group(2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.slow  # a real server with the default model
def test_long_run_against_a_running_server(server, tmp_path, capsys):
    grpc_url, http_url = server
    out = tmp_path / "served"
    assert (
        main(
            [
                "long-run",
                str(out),
                "--endpoint",
                grpc_url,
                "--endpoint",
                http_url,
                "--turns",
                "3",
                "--max-new-tokens",
                "4",
                "--turns-per-bucket",
                "1",
                "--quiet",
            ]
        )
        == 0
    ), capsys.readouterr().err
    table = pd.read_csv(out / "turns.csv")
    assert sorted(table.groupby("arm")["turn"].apply(list).to_dict().items()) == [
        ("grpc_session", [0, 1, 2]),
        ("http_reuse", [0, 1, 2]),
        ("http_stateless", [0, 1, 2]),
    ]
    assert (table["kv_live_bytes"] > 0).all()
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["model"]["name"] == DEFAULT_MODEL
        and metrics["server_cache"]["budget_tokens"] == SINK + WINDOW
    )
    m = metrics["metrics"]
    assert m["partial"] is False and m["abort_reason"] is None and m["duration_s"] > 0
    stateless = m["arms"]["http_stateless"]
    assert (
        stateless["turns"] == 3
        and stateless["latency"]["turn_latency_s"]["p95"]
        >= stateless["latency"]["turn_latency_s"]["p50"]
        > 0
    )
    assert len(stateless["buckets_by_turns"]) == 3
    # a served run does not resume: a second run into the same folder is refused
    assert (
        main(["long-run", str(out), "--endpoint", grpc_url, "--endpoint", http_url, "--turns", "3"])
        == 2
    )


@pytest.mark.parametrize(
    "endpoints,said",
    [
        (["grpc://127.0.0.1:1"], "no http endpoint"),
        (["http://127.0.0.1:1"], "no grpc endpoint"),
        (["grpc://127.0.0.1:1", "grpc://127.0.0.1:2"], "two grpc endpoints"),
        (["grpc://127.0.0.1", "http://127.0.0.1:1"], "is not grpc://HOST:PORT"),
        (["ftp://127.0.0.1:1", "http://127.0.0.1:1"], "is not grpc://HOST:PORT"),
        (["grpc://127.0.0.1:1", "http://127.0.0.1:1/v1"], "is not grpc://HOST:PORT"),
    ],
)
def test_bad_endpoints_are_refused(endpoints, said, tmp_path, capsys):
    argv = ["long-run", str(tmp_path / "out")]
    for e in endpoints:
        argv += ["--endpoint", e]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra,said",
    [
        (["--arms", "sink_window"], "unknown served arm(s) ['sink_window']"),
        (["--duration-s", "60"], "--duration-s is not supported with --endpoint"),
        (["--proposer", "ngram"], "--proposer is not supported with --endpoint"),
        ([], "cannot reach the server"),  # nothing listens on port 1
    ],
)
def test_served_arguments_checked_and_unreachable_server_is_a_user_error(
    extra, said, tmp_path, capsys
):
    argv = [
        "long-run",
        str(tmp_path / "out"),
        "--endpoint",
        "grpc://127.0.0.1:1",
        "--endpoint",
        "http://127.0.0.1:1",
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "out").exists()


def test_parse_endpoints():
    e = parse_endpoints(["http://localhost:8000", "grpc://10.0.0.2:50051"])
    assert e.grpc_target == "10.0.0.2:50051" and e.http_base == "http://localhost:8000"
