"""The ``kakeya-lab`` command line: a table of commands, each owned by its subpackage.

    kakeya-lab models list [--json]
    kakeya-lab models pull NAME [--force] [--quiet]
    kakeya-lab models verify [NAME ...]
    kakeya-lab chat [--model NAME] [--sink 4] [--window 1020] [--proposer ngram] ...
    kakeya-lab run NOTEBOOK [-p NAME VALUE ...] [--results DIR] [--experiment NAME]
    kakeya-lab sweep FILE.yaml [--profile smoke|full] [--executor local|ray] [--force-new]
    kakeya-lab long-run OUT_DIR [--turns N | --duration-s S] [--arms ...] [--window W] [--backend torch|mlx] [--force-new]
    kakeya-lab long-run OUT_DIR --endpoint grpc://HOST:PORT --endpoint http://HOST:PORT [--turns N]
    kakeya-lab align capture OUT_DIR [--domain chitchat|code|prose] [--split train|dev] ...
    kakeya-lab align train NAME [--verifier MODEL] [--kind feature|block|lora] [--steps N] ...
    kakeya-lab align list [--json]
    kakeya-lab evidence check [ROOT]
    kakeya-lab serve [--model NAME] [--backend torch|mlx] [--grpc-port P] [--http-port P] ...

This module only dispatches: :data:`COMMANDS` maps a command name to the function that
runs it (``"module:function"``, ``main(argv) -> int``), imported only when that command
is given. Each command module builds its own parser, checks every argument (before a model
loads or anything is written) and imports torch and the heavy modules only then, so
``--help`` and argument errors cost next to nothing. Shared argument groups, checks and
exit codes: :mod:`kakeya_lab.cli_args`.

Exit status: 0 on success; 1 when a run ran but failed (a notebook raised, a sweep had
failing runs, every turn of a long run failed); 2 for user errors (bad or inconsistent
arguments, unknown model, model not available offline, a resume with other settings),
printed as one line on stderr without a traceback and before anything is written; 130 on
Ctrl-C. ``long-run`` stopped by SIGTERM or SIGINT finishes the turn under way, writes its
checkpoint and a partial report (``partial: true``, ``abort_reason`` the signal's name) and
exits 128 + the signal number (143 for SIGTERM, 130 for SIGINT): not a failure of the run,
which resumes when run again. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kakeya_lab.cli_args import EXIT_USER_ERROR, PROG, Parser, usage


class Command(NamedTuple):
    """A ``kakeya-lab`` command: where its ``main(argv) -> int`` lives and its one-line help."""

    target: str  # "package.module:function"
    help: str


COMMANDS: dict[str, Command] = {
    "models": Command("kakeya_lab.models.command:main", "the local model store"),
    "chat": Command("kakeya_lab.chat_command:main", "interactive multi-turn chat on one session"),
    "run": Command(
        "kakeya_lab.experiments.command:run_main",
        "execute a parameterised notebook into a run folder",
    ),
    "sweep": Command(
        "kakeya_lab.experiments.command:sweep_main",
        "run a sweep file (notebook x parameter grid)",
    ),
    "long-run": Command(
        "kakeya_lab.bench.long_run.command:main",
        "long multi-turn session benchmark (resumable)",
    ),
    "align": Command(
        "kakeya_lab.align.command:main", "proposer alignment: rollouts, training, evaluation"
    ),
    "evidence": Command("kakeya_lab.evidence_command:main", "README figures against evidence/"),
    "serve": Command(
        "kakeya_lab.serve.command:main",
        "serve sessions: gRPC session API + OpenAI-compatible HTTP",
    ),
}


def build_parser() -> Parser:
    """The top-level parser: lists :data:`COMMANDS` in ``--help`` and refuses unknown ones
    (each command parses its own arguments)."""
    parser = Parser(
        prog=PROG,
        description="kakeya_lab: sink-window KV caches and speculative decoding on real LLMs.",
        epilog=f"`{PROG} COMMAND --help` describes a command.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        subparsers.add_parser(name, help=command.help, add_help=False)
    return parser


def command_main(name: str) -> Callable[[Sequence[str]], int]:
    """Import command ``name``'s module and return its ``main``."""
    module, _, function = COMMANDS[name].target.partition(":")
    main_of_command: Callable[[Sequence[str]], int] = getattr(
        importlib.import_module(module), function
    )
    return main_of_command


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return command_main(args[0])(args[1:])
    parser = build_parser()
    try:
        parser.parse_args(args)  # prints --help (exit 0) or the usage error (exit 2)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    return usage(parser)  # no command given


if __name__ == "__main__":
    sys.exit(main())
