"""Every misuse of the command line fails fast and cleanly: exit status 2, one line on
stderr, no traceback, nothing written, and no model loaded.

The table runs twice: in-process through ``kakeya_lab.cli.main`` (fast loop), and as real
``kakeya-lab`` subprocesses (slow: each starts Python and imports torch), watched for a
model load rather than timed (``tests/cli_watch.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_watch import run_watched

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "notebooks" / "00_quickstart.ipynb"
LONG = ["long-run", "{out}", "--turns", "3"]
CHAT = ["chat"]
CAPTURE = ["align", "capture", "{out}"]

# (case id, argv with {out}/{tmp} placeholders, what the message must say)
MISUSES = [
    ("long-run turns 0", [*LONG[:2], "--turns", "0"], "--turns must be >= 1"),
    (
        "long-run checkpoint-every 0",
        [*LONG, "--checkpoint-every", "0"],
        "--checkpoint-every must be >= 1",
    ),
    (
        "long-run duration -1",
        [*LONG, "--duration-s", "-1"],
        "--duration-s must be a finite number > 0",
    ),
    ("long-run duration nan", [*LONG, "--duration-s", "nan"], "--duration-s"),
    (
        "long-run max-new-tokens 0",
        [*LONG, "--max-new-tokens", "0"],
        "--max-new-tokens must be >= 1",
    ),
    ("long-run window 0", [*LONG, "--window", "0"], "--window must be between 1 and"),
    ("long-run window 2**70", [*LONG, "--window", str(2**70)], "--window must be between 1 and"),
    ("long-run sink -1", [*LONG, "--sink", "-1"], "--sink must be between 0 and"),
    ("long-run unknown arm", [*LONG, "--arms", "sink_window,bogus"], "unknown arm(s) ['bogus']"),
    ("long-run no arms", [*LONG, "--arms", ","], "no arms given"),
    ("long-run repeated arm", [*LONG, "--arms", "full_cache,full_cache"], "named twice"),
    ("long-run positions", [*LONG, "--positions", "diagonal"], "invalid choice: 'diagonal'"),
    ("long-run turns not a number", [*LONG[:2], "--turns", "many"], "invalid int value: 'many'"),
    ("long-run probe-every -1", [*LONG, "--probe-every", "-1"], "--probe-every must be >= 0"),
    ("long-run reprefill cap 0", [*LONG, "--reprefill-cap-s", "0"], "--reprefill-cap-s"),
    (
        "long-run turns-per-bucket 0",
        [*LONG, "--turns-per-bucket", "0"],
        "--turns-per-bucket must be >= 1",
    ),
    (
        "long-run unknown model",
        [*LONG, "--model", "no-such-model"],
        "'no-such-model' is not a registry model",
    ),
    (
        "long-run out is a file",
        ["long-run", "{tmp}/afile", "--turns", "3"],
        "exists and is not a folder",
    ),
    (
        "long-run out under a file",
        ["long-run", "{tmp}/afile/run", "--turns", "3"],
        "afile is not a folder",
    ),
    ("capture out is a file", ["align", "capture", "{tmp}/afile"], "exists and is not a folder"),
    ("chat unknown proposer", [*CHAT, "--proposer", "oracle"], "unknown proposer 'oracle'"),
    ("chat early-exit not a number", [*CHAT, "--proposer", "early-exit:x"], "bad layer count"),
    (
        "run results is a file",
        ["run", "notebooks/00_quickstart.ipynb", "--results", "{tmp}/afile"],
        "exists and is not a folder",
    ),
    ("chat negative seed", [*CHAT, "--seed", "-1"], "--seed: seed must be >= 0"),
    (
        "chat seed over 2**63-1",
        [*CHAT, "--seed", str(2**63)],
        "seed must be <= 9223372036854775807",
    ),
    ("chat tiny temperature", [*CHAT, "--temperature", "1e-45"], "0 (greedy) or at least"),
    (
        "chat unknown proposer module",
        [*CHAT, "--proposer-module", "{tmp}/none.py"],
        "no proposer module",
    ),
    (
        "chat draft model unknown",
        [*CHAT, "--proposer", "draft:no-such-model"],
        "is not a registry model",
    ),
    ("chat draft length 0", [*CHAT, "--draft-length", "0"], "--draft-length must be >= 1"),
    (
        "chat temperature -1",
        [*CHAT, "--temperature", "-1"],
        "--temperature must be a finite number >= 0",
    ),
    ("chat max-new-tokens 0", [*CHAT, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("chat unknown model", [*CHAT, "--model", "./nowhere"], "is not a registry model"),
    (
        "run missing notebook",
        ["run", "{tmp}/missing.ipynb", "--results", "{out}"],
        "no notebook at",
    ),
    (
        "run unknown parameter",
        ["run", str(QUICKSTART), "-p", "turnz", "3", "--results", "{out}"],
        "unknown parameter(s) ['turnz']",
    ),
    (
        "run reserved parameter",
        ["run", str(QUICKSTART), "-p", "run_dir", "x", "--results", "{out}"],
        "are set by the runner",
    ),
    (
        "sweep missing file",
        ["sweep", "{tmp}/missing.yaml", "--results", "{out}"],
        "no sweep file at",
    ),
    (
        "sweep unknown profile",
        ["sweep", "{tmp}/ok.yaml", "--profile", "huge", "--results", "{out}"],
        "unknown profile 'huge'",
    ),
    ("capture conversations 0", [*CAPTURE, "--conversations", "0"], "--conversations must be >= 1"),
    (
        "capture min-confidence 2",
        [*CAPTURE, "--min-confidence", "2"],
        "--min-confidence must be in (0, 1]",
    ),
    ("capture unknown domain", [*CAPTURE, "--domain", "poetry"], "invalid choice: 'poetry'"),
    ("capture window 0", [*CAPTURE, "--window", "0"], "--window must be between 1 and"),
    (
        "serve onednn on mlx",
        ["serve", "--backend", "mlx", "--linear", "onednn"],
        "--linear onednn is a torch kernel",
    ),
    (
        "long-run onednn on mlx",
        ["long-run", "{out}", "--backend", "mlx", "--linear", "onednn"],
        "--linear onednn is a torch kernel",
    ),
    ("chat unknown kernel", ["chat", "--linear", "fast"], "invalid choice: 'fast'"),
    (
        "models kernels unknown model",
        ["models", "kernels", "no-such-model"],
        "NAME 'no-such-model' is not a registry model",
    ),
    (
        "chat draft kernel unknown model",
        [*CHAT, "--proposer", "draft:no-such-model:int4"],
        "'no-such-model' is not a registry model",
    ),
    (
        "long-run draft kernel on mlx",
        [
            "long-run",
            "{out}",
            "--backend",
            "mlx",
            "--arms",
            "speculative",
            "--proposer",
            "suffix+draft:smollm2-135m-instruct:int4",
        ],
        "a draft model's kernel is a torch kernel",
    ),
    ("chat quantised verifier", ["chat", "--linear", "int8"], "invalid choice: 'int8'"),
    (
        "chat draft window without a draft model",
        ["chat", "--draft-window", "64"],
        "--draft-window 64 needs a draft:MODEL proposer",
    ),
    (
        "chat draft window 0",
        ["chat", "--proposer", "draft:smollm2-135m-instruct", "--draft-window", "0"],
        "--draft-window must be >= 1",
    ),
    ("unknown command", ["frobnicate"], "invalid choice: 'frobnicate'"),
]


CASES = [pytest.param(a, s, id=i) for i, a, s in MISUSES]


def _prepare(tmp_path: Path, argv: list[str]) -> tuple[list[str], list[str]]:
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "ok.yaml").write_text(
        f"notebook: {QUICKSTART}\ngrid:\n  turns: [2]\nprofiles:\n  smoke: {{}}\n"
    )
    before = sorted(p.name for p in tmp_path.iterdir())
    return [a.format(out=tmp_path / "out", tmp=tmp_path) for a in argv], before


@pytest.mark.parametrize("argv,said", CASES)
def test_misuse_in_process(argv, said, tmp_path, capsys):
    from kakeya_lab.cli import main

    args, before = _prepare(tmp_path, argv)
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kakeya-lab: error: ") and said in lines[0], (
        captured.err
    )
    assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.slow
@pytest.mark.parametrize("argv,said", CASES)
def test_misuse_as_a_subprocess(argv, said, tmp_path):
    args, before = _prepare(tmp_path, argv)
    proc, loaded, _ = run_watched(args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("kakeya-lab: error: ") and said in lines[0], lines[0]
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no folder made
    assert loaded == [], f"a model loaded before the check: {loaded}"


@pytest.mark.parametrize("group", [[], ["models"], ["align"], ["evidence"]])
def test_a_bare_command_group_says_what_to_give_in_one_line(group, capsys):
    from kakeya_lab.cli import main

    assert main(group) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "give a command:" in lines[0] and "--help" in lines[0], lines


@pytest.mark.parametrize(
    "argv, want",
    [
        (["serve"], "auto"),
        (["chat"], "auto"),
        (["serve", "--backend", "mlx"], "aten"),  # MLX has its own kernels: none of torch's
        (["serve", "--linear", "aten"], "aten"),
        (["long-run", "out"], "aten"),  # a run's kernel is a setting its identity records
    ],
)
def test_an_unset_linear_is_the_commands_default_for_its_backend(argv, want):
    """``serve`` and ``chat`` run the fastest kernel measured here (``auto``) unless told
    otherwise; a long run keeps ``aten`` (resuming an older run must not change its kernel)."""
    from kakeya_lab.bench.long_run.command import build_parser as long_run_parser
    from kakeya_lab.chat_command import build_parser as chat_parser
    from kakeya_lab.cli_args import check_linear
    from kakeya_lab.serve.command import build_parser as serve_parser

    parsers = {"serve": serve_parser, "chat": chat_parser, "long-run": long_run_parser}
    args = parsers[argv[0]]().parse_args(argv[1:])
    check_linear(args)
    assert args.linear == want
