"""The durable served long run against real servers: SIGTERM leaves a valid partial report
and a resume gives the uninterrupted run's replies; a refused turn is counted, not fatal;
the error budget; a server restart mid-run; ``duration_s`` cycling the turns; one
endpoint alone; the served proposer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("grpc", reason="needs the serve extra")
pytest.importorskip("openai", reason="needs the serve extra")

from kakeya_lab.bench.long_run import served_driver  # noqa: E402
from kakeya_lab.bench.long_run.served import Endpoints, run_served  # noqa: E402
from kakeya_lab.bench.long_run.settings import LongRunSettings  # noqa: E402
from kakeya_lab.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SINK, WINDOW = 4, 40
TURNS = ["Hi!", "How are you today?", "Tell me about the sea.", "Thanks, bye."]


@pytest.fixture(scope="module")
def server(serve):
    """A real ``kakeya-lab serve`` (default model, a small sink-window cache)."""
    return serve("--sink", str(SINK), "--window", str(WINDOW))


def _cli(out: Path, server, *extra: str) -> list[str]:
    return [
        "long-run",
        str(out),
        "--endpoint",
        f"grpc://{server.grpc_target}",
        "--endpoint",
        server.http_base,
        "--max-new-tokens",
        "4",
        "--turns-per-bucket",
        "1",
        "--quiet",
        *extra,
    ]


def _replies(table: pd.DataFrame) -> dict[tuple[str, int], str]:
    """Per (arm, turn) the reply's digest: the gRPC reply's token ids, an HTTP reply's text."""
    digest = table["reply_ids_sha256"].fillna(table["reply_sha256"])
    return {(a, int(t)): d for a, t, d in zip(table["arm"], table["turn"], digest, strict=True)}


@pytest.mark.slow  # a real server, two runs and a subprocess
def test_sigterm_leaves_a_partial_report_and_resume_equals_the_uninterrupted_run(
    server, tmp_path, capsys, monkeypatch
):
    flags = ["--turns", "6", "--checkpoint-every", "1", "--turn-spacing-s", "1.0"]
    whole = tmp_path / "whole"
    assert main(_cli(whole, server, *flags)) == 0, capsys.readouterr().err
    expected = _replies(pd.read_csv(whole / "served_turns.csv"))
    assert len(expected) == 18

    cut = tmp_path / "cut"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kakeya_lab.cli", *_cli(cut, server, *flags)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # two rounds reported
            path, rows = cut / "metrics.json", cut / "served_turns.csv"
            if path.exists() and rows.exists() and pd.read_csv(rows)["turn"].max() >= 1:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=120)
        assert status == 128 + signal.SIGTERM, (status, proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
    metrics = json.loads((cut / "metrics.json").read_text())
    m = metrics["metrics"]
    assert m["partial"] is True and m["abort_reason"] == "SIGTERM"
    record = json.loads((cut / "run.json").read_text())
    assert record["status"] == "partial"
    partial = pd.read_csv(cut / "served_turns.csv")
    done = int(partial["turn"].max()) + 1
    assert 2 <= done < 6 and len(partial) == 3 * done, partial[["arm", "turn"]]  # whole rounds

    # a resume with another proposer is refused before anything is sent; nothing changes
    before = (cut / "checkpoint.json").read_bytes()
    assert main(_cli(cut, server, *flags, "--proposer", "ngram")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "proposer" in err[0], err
    assert (cut / "checkpoint.json").read_bytes() == before

    # the gRPC session is re-created from its recorded history in pieces of this many
    # tokens (a multi-hour history passes the server's append limit): several pieces here
    monkeypatch.setattr(served_driver, "RESEND_CHUNK", 16)
    assert main(_cli(cut, server, *flags)) == 0, capsys.readouterr().err
    resumed = pd.read_csv(cut / "served_turns.csv")
    got = _replies(resumed)
    assert got == expected, sorted(k for k in expected if got.get(k) != expected[k])
    metrics = json.loads((cut / "metrics.json").read_text())
    assert metrics["metrics"]["partial"] is False and metrics["metrics"]["abort_reason"] is None
    marks = [e for e in metrics["metrics"]["served_events"] if e["kind"] == "resume"]
    assert sorted(e["arm"] for e in marks) == ["grpc_session", "http_reuse", "http_stateless"]
    grpc_mark = next(e for e in marks if e["arm"] == "grpc_session")
    assert grpc_mark["turn"] == done and grpc_mark["reprefill_tokens"] > 2 * 16
    assert grpc_mark["reprefill_tokens"] > SINK + WINDOW  # the re-sent history evicts
    first = resumed[resumed["turn"] == done]
    assert first["resumed"].all() and (first["session_epoch"] == 1).all()
    assert json.loads((cut / "run.json").read_text())["status"] == "completed"


@pytest.mark.slow  # a real server
def test_refused_turns_are_counted_not_fatal_and_the_budget_stops_the_run(serve, tmp_path):
    small = serve("--sink", str(SINK), "--window", str(WINDOW), "--max-append-tokens", "64")
    endpoints = Endpoints(grpc_target=small.grpc_target, http_base=small.http_base)
    turns = ["Hi!", "tell me " * 60, "Bye."]  # the server refuses the second append
    settings = LongRunSettings(
        arms=(), served_arms=("grpc_session",), turns=3, max_new_tokens=2, max_errors=1
    )
    run = run_served(endpoints, settings, turns, catch_signals=False)
    table = run.turns.set_index("turn")
    assert run.abort_reason is None and run.partial is False
    assert table.loc[0, "error"] is None or pd.isna(table.loc[0, "error"])
    assert "INVALID_ARGUMENT" in table.loc[1, "error"]
    assert pd.isna(table.loc[2, "error"]) and table.loc[2, "generated_tokens"] > 0
    assert run.summary["grpc_session"]["errors"] == 1
    # the session was re-created from the recorded history, then the run went on
    assert [e["kind"] for e in run.events] == ["after_error"]
    assert table.loc[2, "session_epoch"] == 1

    strict = LongRunSettings(**{**settings.to_dict(), "max_errors": 0})
    out = tmp_path / "budget"
    stopped = run_served(endpoints, strict, turns, catch_signals=False, out_dir=out)
    assert stopped.abort_reason == "max_errors" and stopped.partial
    assert "1 failed turns, more than max_errors 0" in stopped.abort_detail
    assert sorted(stopped.turns["turn"]) == [0, 1]  # stopped after the failing round


@pytest.mark.slow  # a real server, started with its default limits
def test_cli_error_budget_exit_and_run_json(serve, tmp_path, capsys):
    tight = serve("--sink", str(SINK), "--window", str(WINDOW), "--max-append-tokens", "8")
    out = tmp_path / "tight"
    argv = ["long-run", str(out), "--endpoint", f"grpc://{tight.grpc_target}", "--turns", "3"]
    assert main([*argv, "--max-new-tokens", "2", "--max-errors", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "max_errors" in err
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "failed" and record["abort_reason"] == "max_errors"
    metrics = json.loads((out / "metrics.json").read_text())["metrics"]
    assert metrics["abort_reason"] == "max_errors" and metrics["served_errors"]["failed_turns"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # two real servers one after the other
def test_a_server_restart_mid_run_is_waited_for_and_recorded(serve, tmp_path):
    from tests.conftest import start_server

    ports = ["--grpc-port", str(_free_port()), "--http-port", str(_free_port())]
    args = ("--sink", str(SINK), "--window", str(WINDOW), *ports)
    first = start_server(*args)
    endpoints = Endpoints(grpc_target=first.grpc_target, http_base=first.http_base)
    settings = LongRunSettings(
        arms=(),
        served_arms=("grpc_session", "http_reuse"),
        turns=len(TURNS),
        max_new_tokens=4,
        checkpoint_every=1,
    )
    restarted: list = []

    def restart(run) -> None:
        if run.partial and int(run.turns["turn"].max()) == 1 and not restarted:
            first.stop()  # the server goes away between rounds 1 and 2
            restarted.append(None)
            threading.Thread(target=lambda: restarted.append(serve(*args)), daemon=True).start()

    try:
        run = run_served(
            endpoints,
            settings,
            TURNS,
            out_dir=tmp_path / "restart",
            on_report=restart,
            catch_signals=False,
            restart_wait_s=600,
        )
    finally:
        first.stop()
    table = run.turns
    assert table["error"].isna().all(), table["error"].dropna().tolist()
    after = table[table["turn"] == 2].set_index("arm")
    assert after["server_restart"].all() and (after["session_epoch"] == 1).all()
    assert not table[table["turn"] != 2]["server_restart"].any()
    kinds = [(e["kind"], e["arm"]) for e in run.events]
    assert ("server_gone", "grpc_session") in kinds and ("server_restart", "grpc_session") in kinds
    # http_reuse's turn after the restart re-prefilled the whole conversation: not measured
    assert not bool(after.loc["http_reuse", "measured"])
    assert run.summary["http_reuse"]["unmeasured_turns"] == 1
    # the re-created gRPC session holds the same history: the same replies as a run without
    # the restart
    second = next(s for s in restarted if s is not None)
    again = run_served(
        Endpoints(grpc_target=second.grpc_target, http_base=None),
        LongRunSettings(arms=(), served_arms=("grpc_session",), turns=len(TURNS), max_new_tokens=4),
        TURNS,
        catch_signals=False,
    )
    grpc = table[table["arm"] == "grpc_session"].set_index("turn")["reply_ids_sha256"]
    assert grpc.to_dict() == again.turns.set_index("turn")["reply_ids_sha256"].to_dict()


@pytest.mark.slow  # a real server
def test_duration_cycles_the_turn_set(server):
    endpoints = Endpoints(grpc_target=server.grpc_target, http_base=None)
    settings = LongRunSettings(
        arms=(),
        served_arms=("grpc_session",),
        turns=3,
        max_new_tokens=2,
        turn_spacing_s=2.0,
        duration_s=13.0,  # rounds start at 0, 2, ..., 12 s: seven of them
    )
    run = run_served(endpoints, settings, TURNS[:3], catch_signals=False)
    table = run.turns.set_index("turn")
    rounds = len(table)
    slots_kept = bool((table["wall_s"] < table.index * 2.0 + 2.0).all())
    assert rounds == 7 if slots_kept else rounds > 3
    assert list(table.index) == list(range(rounds))
    # the same message again after the set ran out: turn 4 is turn 1's text
    assert table.loc[4, "user_tokens"] == table.loc[1, "user_tokens"]


@pytest.mark.slow  # a real server
def test_one_endpoint_alone_and_arms_that_need_the_other(server, tmp_path, capsys):
    grpc_only = tmp_path / "grpc"
    argv = ["long-run", str(grpc_only), "--endpoint", f"grpc://{server.grpc_target}"]
    small = ["--turns", "2", "--max-new-tokens", "2", "--quiet"]
    assert main([*argv, *small]) == 0, capsys.readouterr().err
    table = pd.read_csv(grpc_only / "served_turns.csv")
    assert set(table["arm"]) == {"grpc_session"} and table["rss_bytes"].isna().all()
    header = json.loads((grpc_only / "metrics.json").read_text())
    assert header["server_cache"]["budget_tokens"] == SINK + WINDOW

    http_only = tmp_path / "http"
    argv = ["long-run", str(http_only), "--endpoint", server.http_base]
    assert main([*argv, *small]) == 0, capsys.readouterr().err
    table = pd.read_csv(http_only / "served_turns.csv")
    assert set(table["arm"]) == {"http_reuse", "http_stateless"}
    assert (table["rss_bytes"] > 0).all()
    assert (
        json.loads((http_only / "metrics.json").read_text())["server_cache"]["budget_tokens"]
        == SINK + WINDOW
    )

    refused = tmp_path / "refused"
    argv = ["long-run", str(refused), "--endpoint", server.http_base, "--arms", "grpc_session"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need a gRPC endpoint" in err[0], err
    assert not refused.exists()


@pytest.mark.slow  # a real server
def test_served_proposer_is_passed_and_an_unserved_one_refused(server, tmp_path, capsys):
    out = tmp_path / "spec"
    gate = ["--prefill-tolerance", "0.2", "--prefill-direction", "both"]
    argv = _cli(out, server, "--turns", "2", "--arms", "grpc_session", "--proposer", "ngram")
    assert main([*argv, *gate]) == 0, capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    gates = metrics["metrics"]["arms"]["grpc_session"]["gates"]
    assert gates["prefill_bounded"]["tolerance"] == 0.2
    assert gates["prefill_bounded"]["direction"] == "both"
    assert {"prefill_bounded", "prefill_flat_vs_history"} <= set(
        metrics["headline"]["grpc_session"]
    )
    assert metrics["proposer"] == {"spec": "ngram", "draft_length": 4, "served": True}
    assert metrics["served_proposer"] == {"spec": "ngram", "draft_length": 4}
    table = pd.read_csv(out / "served_turns.csv")
    assert table["error"].isna().all()

    refused = tmp_path / "refused"
    argv = _cli(refused, server, "--turns", "2", "--proposer", "draft:smollm2-135m-instruct")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--proposer: the server refuses" in err[0], err
    assert not (refused / "run.json").exists()
