"""``kakeya-lab evidence check [ROOT]``: docs/results.md and the README's headline table
against the committed evidence folders (:func:`kakeya_lab.evidence.check_evidence`); exit 1 if a claim fails."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from kakeya_lab.cli_args import EXIT_RUN_FAILED, PROG, Parser, UserError, run_parser, usage


def build_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab evidence`` parser (``check``)."""
    evidence = Parser(
        prog=f"{PROG} evidence",
        description="docs/results.md and the README's headline figures against evidence/.",
    )
    sub = evidence.add_subparsers(dest="evidence_command", metavar="EVIDENCE_COMMAND")
    evidence.set_defaults(func=lambda _args: usage(evidence))
    p = sub.add_parser(
        "check", help="check every claims.yaml, docs/results.md section and README headline row"
    )
    p.add_argument("root", nargs="?", default=".", help="repository root (default: .)")
    p.set_defaults(func=run_check)
    return evidence


def run_check(args: argparse.Namespace) -> int:
    """Check docs/results.md and the README's headline table against the evidence folders."""
    from kakeya_lab.evidence import check_evidence

    root = Path(args.root)
    if not (root / "README.md").is_file():
        raise UserError(f"no README.md in {root}: pass the repository root")
    problems = check_evidence(root)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)" if problems else "evidence: every claim holds")
    return EXIT_RUN_FAILED if problems else 0


def main(argv: Sequence[str]) -> int:
    """``kakeya-lab evidence ARGV``; returns the exit status."""
    return run_parser(build_parser(), argv)
