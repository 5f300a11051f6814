"""What every ``kakeya-lab`` command shares: the parser class, exit codes, the common
argument groups (model, backend, cache size, linear kernel, proposer) and their checks.

Torch-free by contract: a command's ``--help`` and its argument errors import only this
module, argparse and the command's own module. Checks that must look something up (a
draft model, a named drafter) import what they need when they run.

Exit status: 0 on success; 1 (:data:`EXIT_RUN_FAILED`) when a run ran but failed; 2
(:data:`EXIT_USER_ERROR`) for user errors, printed as one line on stderr without a
traceback and before anything is written; 130 on Ctrl-C. Anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kakeya_lab.backends.config import SinkWindowConfig

PROG = "kakeya-lab"
EXIT_RUN_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
MAX_CACHE_TOKENS = 1 << 24  # a sink or window beyond this cannot be held on any machine we target
VERIFIER_KERNELS = (
    "aten",
    "onednn",
    "split",
    "exact",
    "auto",
)  # --linear: the quantised kernels are for draft models
POSITIONS = ("global", "rolling")

# Exceptions that mean "the user asked for something impossible" (exit 2), by module:
# a module that was never imported cannot have raised its error, so none is imported here.
_USER_ERRORS = (
    ("kakeya_lab.models.errors", "ModelStoreError"),
    ("kakeya_lab.session", "SessionError"),
    ("kakeya_lab.align.rollouts", "RolloutError"),
    ("kakeya_lab.proposers.drafters.checkpoint", "CheckpointError"),
    ("kakeya_lab.resume", "ResumeError"),
)


class UserError(Exception):
    """An error caused by the user's input: printed on one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (``kakeya-lab: error: PROG: ...; see --help``)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{PROG}: error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


def usage(parser: argparse.ArgumentParser) -> int:
    """One line on stderr for a command group called without a sub-command: the commands
    it has and where its help is; returns the user-error exit status."""
    commands = [
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]
    print(
        f"{parser.prog}: give a command: {', '.join(commands)} (see {parser.prog} --help)",
        file=sys.stderr,
    )
    return EXIT_USER_ERROR


def user_error_types() -> tuple[type[BaseException], ...]:
    """:class:`UserError` and the package's user-facing errors already imported."""
    found: list[type[BaseException]] = [UserError]
    for module, name in _USER_ERRORS:
        if module in sys.modules:
            found.append(getattr(sys.modules[module], name))
    return tuple(found)


def run_parser(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """Parse ``argv`` and call the chosen ``func`` (``args -> int``, set with
    ``set_defaults``); turn user errors and Ctrl-C into their exit status."""
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if not isinstance(exc, user_error_types()):
            raise
        message = " ".join(str(exc).split())  # always one line
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


def parameters(args: argparse.Namespace, *drop: str) -> dict:
    """Every option of this invocation (for a run record), without ``func`` and ``drop``."""
    return {k: v for k, v in vars(args).items() if k not in ("func", *drop)}


# --------------------------------------------------------------------------- argument groups


def add_model(p: argparse.ArgumentParser, flag: str = "--model", help: str | None = None) -> None:
    """``--model NAME`` (default: the registry's default model)."""
    from kakeya_lab.models.registry import DEFAULT_MODEL

    p.add_argument(flag, default=DEFAULT_MODEL, help=help)


def add_backend(p: argparse.ArgumentParser, default: str | None, help: str | None = None) -> None:
    """``--backend torch|mlx``."""
    from kakeya_lab.backends import registry

    p.add_argument("--backend", choices=list(registry.names()), default=default, help=help)


def add_cache(p: argparse.ArgumentParser, *, window: int, positions: bool = True) -> None:
    """``--sink``, ``--window`` (and ``--positions``): the sink-window cache size."""
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=window)
    if positions:
        p.add_argument("--positions", choices=list(POSITIONS), default="global")


def add_linear(p: argparse.ArgumentParser, *, default: str = "aten") -> None:
    """``--linear aten|onednn|split|exact|auto``: the torch verifier's linear-layer kernel.
    ``default`` is the torch backend's; on another backend, which has its own kernels, an
    unset ``--linear`` means ``aten`` (none of them) (:func:`check_linear` resolves it)."""
    p.add_argument(
        "--linear",
        choices=list(VERIFIER_KERNELS),
        default=None,
        help="the torch model's linear-layer kernel: aten (PyTorch's default), onednn "
        "(oneDNN's; on CPU a block of a few draft tokens costs little more than one token), "
        "split (each product's output rows split over the threads), exact (split's numbers, "
        "each weight read from its exact 4- or 8-bit form where it has one, as a dequantised "
        "GGUF's) or auto (the fastest of them on this machine for each row count, measured "
        f"once and cached); default {default}",
    )
    p.set_defaults(linear_default=default)


def add_proposer_modules(p: argparse.ArgumentParser) -> None:
    """``--proposer-module FILE_OR_MODULE`` (repeatable): imported first, for the proposer
    kinds it registers (docs/extending.md)."""
    p.add_argument(
        "--proposer-module",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="a Python file or module that registers proposer kinds (register_proposer); "
        "imported before the proposer spec is checked; repeatable",
    )


def load_proposer_modules(args: argparse.Namespace) -> None:
    """Import every ``--proposer-module`` (a clear error for one that fails)."""
    sources = getattr(args, "proposer_module", None) or []
    if not sources:
        return
    from kakeya_lab.proposers.registry import load_proposer_module

    for source in sources:
        try:
            load_proposer_module(source)
        except ValueError as exc:
            raise UserError(f"--proposer-module: {exc}") from None


def add_proposer(p: argparse.ArgumentParser, default: str | None, help: str) -> None:
    """``--proposer SPEC``; ``help`` says what it is for, the spec grammar is appended."""
    from kakeya_lab.proposers.registry import usage

    p.add_argument("--proposer", default=default, help=f"{help}: {usage()}")


def add_draft_options(p: argparse.ArgumentParser) -> None:
    """``--draft-window``: a draft model proposer's own cache window."""
    p.add_argument(
        "--draft-window",
        type=int,
        default=None,
        help="a draft:MODEL proposer's own cache window (default: --window); with a shorter "
        "one it attends over fewer entries once the history outgrows it",
    )


# --------------------------------------------------------------------------- checks


def check_int(name: str, value: int, minimum: int, maximum: int | None = None) -> None:
    """Raise :class:`UserError` unless ``minimum <= value (<= maximum)``."""
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise UserError(f"{name} must be {bound}, got {value}")


def check_positive(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    """Raise :class:`UserError` unless ``value`` is None or a finite number > 0 (>= 0)."""
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise UserError(
            f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}"
        )


def check_sampling(args: argparse.Namespace) -> None:
    """``--temperature`` and ``--seed`` as :class:`~kakeya_lab.sampling.SamplingConfig`
    takes them (a seed in 0..2**63-1; a temperature of 0 or at least its minimum), checked
    before any model loads."""
    from kakeya_lab.sampling import SamplingConfig

    check_positive("--temperature", args.temperature, allow_zero=True)
    for flag, field in (("--temperature", "temperature"), ("--seed", "seed")):
        try:
            SamplingConfig(**{field: getattr(args, field)})
        except ValueError as exc:  # InputTypeError is one too
            raise UserError(f"{flag}: {exc}") from None


def check_cache(args: argparse.Namespace) -> None:
    """Check ``--sink/--window`` (``--positions`` is checked by argparse)."""
    check_int("--sink", args.sink, 0, MAX_CACHE_TOKENS)
    check_int("--window", args.window, 1, MAX_CACHE_TOKENS)


def cache_config(args: argparse.Namespace) -> SinkWindowConfig:
    """The :class:`~kakeya_lab.backends.config.SinkWindowConfig` of checked ``--sink/--window/--positions``."""
    from kakeya_lab.backends.config import SinkWindowConfig

    check_cache(args)
    try:
        return SinkWindowConfig(
            sink=args.sink, window=args.window, positions=getattr(args, "positions", "global")
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def check_out_dir(path: str, what: str = "OUT_DIR") -> Path:
    """A folder that exists or can be created by this user (nothing is created here)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{what} {out} exists and is not a folder")
    existing = next((p for p in (out, *out.absolute().parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise UserError(f"{what} {out}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what} {out}: cannot write in {existing}")
    return out


def check_model(name: str, flag: str = "--model") -> None:
    """A registry name, an existing folder, or a Hub id already in the local Hugging Face
    cache (checked without loading anything or touching the network)."""
    from kakeya_lab.models.errors import UnknownModelError
    from kakeya_lab.models.registry import get_spec

    try:
        get_spec(name)
        return
    except UnknownModelError:
        pass
    if Path(name).expanduser().is_dir():
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # noqa: BLE001 - a malformed id is simply not in the cache
        pass
    raise UserError(
        f"{flag} {name!r} is not a registry model (see `{PROG} models list`), not a local folder "
        "and not in the local Hugging Face cache"
    )


def check_proposer(spec: str | None) -> None:
    """A proposer spec's syntax, and the draft models and named drafters it names (looked
    up without loading a model)."""
    from kakeya_lab.proposers.builtin import draft_model_spec
    from kakeya_lab.proposers.registry import check_proposer_spec, proposer_kind

    try:
        leaves = check_proposer_spec(spec)
    except ValueError as exc:
        raise UserError(f"--proposer {spec}: {exc}") from None
    for kind, arg in leaves:
        needs = proposer_kind(kind).needs
        if needs == "draft model":
            check_model(draft_model_spec(arg)[0], f"--proposer {kind}:")
        elif needs == "named drafter":
            from kakeya_lab.proposers.drafters.named import read_record

            record = read_record(arg)  # DrafterNotFound (lists the names) before a model loads
            if proposer_kind(kind).tree and record.get("kind") != "feature":
                raise UserError(
                    f"{spec!r}: draft trees need a feature drafter; {arg!r} is a "
                    f"{record.get('kind')} drafter (use drafter:{arg})"
                )


def linear_of(args: argparse.Namespace) -> str:
    """``--linear`` as given, else the command's default on the torch backend and ``aten``
    (no torch kernel) on another."""
    if args.linear is not None:
        return str(args.linear)
    return args.linear_default if getattr(args, "backend", None) in (None, "torch") else "aten"


def check_linear(args: argparse.Namespace) -> None:
    """``--linear``, a draft model's kernel and ``--draft-window`` against ``--backend`` and
    ``--proposer`` (a bad spec is left to :func:`check_proposer`)."""
    from kakeya_lab.proposers.builtin import draft_model_spec
    from kakeya_lab.proposers.registry import check_proposer_spec, proposer_kind

    backend = getattr(args, "backend", None)
    args.linear = linear_of(args)
    if backend not in (None, "torch") and args.linear != "aten":
        raise UserError(
            f"--linear {args.linear} is a torch kernel; the {backend} backend has its own"
        )
    try:
        drafts = [
            draft_model_spec(arg)
            for kind, arg in check_proposer_spec(getattr(args, "proposer", None))
            if proposer_kind(kind).needs == "draft model"
        ]
    except ValueError:
        return
    if backend not in (None, "torch") and any(kernel for _, kernel in drafts):
        raise UserError(
            f"--proposer {args.proposer}: a draft model's kernel is a torch kernel; "
            f"the {backend} backend has its own"
        )
    if getattr(args, "draft_window", None) is not None:
        if not drafts:
            raise UserError(f"--draft-window {args.draft_window} needs a draft:MODEL proposer")
        check_int("--draft-window", args.draft_window, 1)


# --------------------------------------------------------------------------- output


def human_size(n: int | None) -> str:
    """``1234567`` → ``"1.2 MB"`` (decimal units); ``None`` → ``"-"``."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"  # pragma: no cover


def table(rows: list[list[str]], header: list[str]) -> str:
    """A plain text table: left-aligned columns, a dashed line under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
