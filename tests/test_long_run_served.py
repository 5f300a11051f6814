"""``kakeya-lab long-run --endpoint``: the served arms against a real running server, into
served_turns.csv and the metrics.json notebook 20 writes too; bad endpoints refused before anything is contacted."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("grpc", reason="needs the serve extra")
pytest.importorskip("openai", reason="needs the serve extra")

from kakeya_lab.bench.long_run.served import parse_endpoints  # noqa: E402
from kakeya_lab.cli import main  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SINK, WINDOW = 4, 40


@pytest.fixture(scope="module")
def server(serve):
    """A real ``kakeya-lab serve`` on free ports (the ``serve`` factory stops it)."""
    started = serve("--sink", str(SINK), "--window", str(WINDOW))
    return f"grpc://{started.grpc_target}", started.http_base


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
    table = pd.read_csv(out / "served_turns.csv")
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
    # the run finished: running it again resumes its checkpoint, which has nothing left to do
    again = ["long-run", str(out), "--endpoint", grpc_url, "--endpoint", http_url]
    assert main([*again, "--turns", "3", "--max-new-tokens", "4", "--turns-per-bucket", "1"]) == 0
    assert len(pd.read_csv(out / "served_turns.csv")) == 9
    # other settings are refused before anything is sent
    assert main([*again, "--turns", "4", "--max-new-tokens", "4", "--turns-per-bucket", "1"]) == 2


@pytest.mark.slow  # a real server with the default model
def test_paced_run_and_the_stateless_cap(server):
    """Rounds start ``turn_spacing_s`` apart; the stateless arm stops after its first
    request over ``stateless_cap_s`` while the session arms go on."""
    from kakeya_lab.bench.long_run.served import run_served_long_run

    grpc_url, http_url = server
    lines: list[str] = []
    df = run_served_long_run(
        grpc_url.removeprefix("grpc://"),
        http_url,
        ["Hi!", "How are you?", "Bye."],
        max_new_tokens=2,
        turn_spacing_s=1.5,
        stateless_cap_s=1e-3,  # every request takes longer
        log=lines.append,
    )
    turns = df.groupby("arm")["turn"].apply(list).to_dict()
    assert turns == {"grpc_session": [0, 1, 2], "http_reuse": [0, 1, 2], "http_stateless": [0]}
    starts = df.groupby("turn")["wall_s"].min()  # wall_s is taken at the end of each turn
    assert starts[2] >= 3.0 and starts[1] >= 1.5
    assert any("http_stateless stopped after turn 0" in line for line in lines)
    with pytest.raises(ValueError, match="turn_spacing_s must be > 0"):
        run_served_long_run(grpc_url, http_url, ["x"], turn_spacing_s=0)


@pytest.mark.parametrize(
    "endpoints,said",
    [
        (["grpc://127.0.0.1:1"], "cannot reach the server"),
        (["http://127.0.0.1:1"], "cannot reach the server"),
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
        (["--duration-s", "0"], "--duration-s must be a finite number > 0"),
        (["--turn-spacing-s", "-1"], "--turn-spacing-s must be a finite number > 0"),
        (["--proposer", "ngram:x"], "--proposer"),
        (["--max-errors", "-1"], "--max-errors must be >= 0"),
        (["--prefill-tolerance", "-0.1"], "--prefill-tolerance must be a finite number >= 0"),
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


@pytest.mark.parametrize(
    "endpoints,arms,said",
    [
        (["grpc://127.0.0.1:1"], "http_reuse", "arm(s) http_reuse need an HTTP endpoint"),
        (["http://127.0.0.1:1"], "grpc_session,http_reuse", "grpc_session need a gRPC endpoint"),
    ],
)
def test_an_arm_without_its_endpoint_is_refused_before_anything_is_contacted(
    endpoints, arms, said, tmp_path, capsys
):
    argv = ["long-run", str(tmp_path / "out"), "--arms", arms]
    for e in endpoints:
        argv += ["--endpoint", e]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not (tmp_path / "out").exists()


def test_parse_one_endpoint_alone():
    assert parse_endpoints(["grpc://127.0.0.1:5"]).http_base is None
    assert parse_endpoints(["http://127.0.0.1:5"]).grpc_target is None
    with pytest.raises(ValueError, match="no endpoint"):
        parse_endpoints([])
