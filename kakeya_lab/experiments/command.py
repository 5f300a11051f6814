"""``kakeya-lab run`` (one notebook into a run folder) and ``kakeya-lab sweep`` (a sweep
file's grid); both refresh the results root's run index."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kakeya_lab.cli_args import (
    EXIT_RUN_FAILED,
    PROG,
    Parser,
    UserError,
    check_out_dir,
    run_parser,
)


def build_run_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab run`` parser."""
    p = Parser(
        prog=f"{PROG} run",
        description="Execute a parameterised notebook with papermill into a run folder.",
    )
    p.add_argument("notebook")
    p.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        metavar=("NAME", "VALUE"),
        help="notebook parameter (value parsed as YAML); repeatable",
    )
    p.add_argument("--results", default="results", help="results root (default: results)")
    p.add_argument("--experiment", default=None, help="run folder group (default: notebook name)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_notebook_command)
    return p


def _parse_parameters(pairs: list[list[str]] | None) -> dict:
    import yaml

    params = {}
    for name, raw in pairs or []:
        try:
            params[name] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise UserError(f"parameter {name}: cannot parse {raw!r}: {exc}") from exc
    return params


def run_notebook_command(args: argparse.Namespace) -> int:
    """Execute a notebook with papermill into a run folder (and refresh the run index)."""
    check_out_dir(args.results, "--results")
    from kakeya_lab.experiments import RunFailed, build_index, run_notebook

    params = _parse_parameters(args.parameter)
    try:
        run_dir = run_notebook(
            args.notebook,
            params,
            results_root=args.results,
            experiment=args.experiment,
            progress=not args.quiet,
        )
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    except RunFailed as exc:
        build_index(args.results)
        print(f"{PROG}: run failed: {exc} (partial run folder: {exc.run_dir})", file=sys.stderr)
        return EXIT_RUN_FAILED
    build_index(args.results)
    from kakeya_lab.results import summary_lines

    for line in summary_lines(run_dir):  # the verdicts, so the reader need not open files
        print(line)
    print(run_dir)
    return 0


def build_sweep_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab sweep`` parser."""
    p = Parser(
        prog=f"{PROG} sweep",
        description="Run every grid point of a sweep file (notebook x parameter grid) not "
        "completed yet.",
    )
    p.add_argument("file")
    p.add_argument("--profile", default=None, help="a profile of the file, e.g. smoke or full")
    p.add_argument(
        "--executor", choices=["local", "ray"], default=None, help="override the file's executor"
    )
    p.add_argument(
        "--ray-address", default=None, help="Ray cluster address (default: start one locally)"
    )
    p.add_argument("--results", default="results")
    p.add_argument(
        "--force-new",
        action="store_true",
        help="re-run runs whose folders hold another notebook version or other parameters",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_sweep_command)
    return p


def run_sweep_command(args: argparse.Namespace) -> int:
    """Run every grid point of a sweep file not completed yet."""
    check_out_dir(args.results, "--results")
    from kakeya_lab.experiments import load_sweep, run_sweep

    try:
        sweep = load_sweep(args.file)
        outcomes = run_sweep(
            sweep,
            profile=args.profile,
            results_root=args.results,
            executor=args.executor,
            ray_address=args.ray_address,
            progress=not args.quiet,
            force_new=args.force_new,
        )
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    counts = outcomes["status"].value_counts().to_dict() if len(outcomes) else {}
    print(
        f"{sweep.name}: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        + f"; index: {args.results}/index.parquet"
    )
    for row in outcomes[outcomes["status"] == "failed"].itertuples() if len(outcomes) else []:
        print(f"  failed {row.run_id}: {row.error}", file=sys.stderr)
    return EXIT_RUN_FAILED if counts.get("failed") else 0


def run_main(argv: Sequence[str]) -> int:
    """``kakeya-lab run ARGV``; returns the exit status."""
    return run_parser(build_run_parser(), argv)


def sweep_main(argv: Sequence[str]) -> int:
    """``kakeya-lab sweep ARGV``; returns the exit status."""
    return run_parser(build_sweep_parser(), argv)
