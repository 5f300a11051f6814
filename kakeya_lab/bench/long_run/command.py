"""``kakeya-lab long-run OUT_DIR``: the long-run session benchmark from the command line.

In-process arms (:func:`kakeya_lab.bench.long_run.run_long`), or with ``--endpoint`` the
served arms against a running ``kakeya-lab serve``. Every argument is checked before a
model loads or anything is written; the run folder's life (``run.json``, reports, the
index) is :mod:`kakeya_lab.experiments.long_run`'s.

Exit status: 0; 1 when the run failed (degenerate, or an arm stopped on failing turns); 2
for user errors; 128 + the signal number when SIGTERM or SIGINT stopped it (a partial
report is written and running the same command resumes).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kakeya_lab.cli_args import (
    EXIT_RUN_FAILED,
    PROG,
    Parser,
    UserError,
    add_backend,
    add_cache,
    add_linear,
    add_model,
    add_proposer,
    check_cache,
    check_linear,
    check_model,
    check_out_dir,
    check_positive,
    check_proposer,
    linear_of,
    run_parser,
)

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run.settings import LongRunSettings
    from kakeya_lab.experiments.long_run import Invocation


def build_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab long-run`` parser."""
    p = Parser(
        prog=f"{PROG} long-run",
        description="A long multi-turn session benchmark into OUT_DIR: cache arms side by side "
        "over the same chat turns, checkpointed (running it again resumes), or the served arms "
        "against a running `kakeya-lab serve` (--endpoint; checkpointed and resumed too).",
    )
    p.add_argument("out_dir")
    add_model(p)
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
        help="drive a running `kakeya-lab serve` instead of an in-process model: "
        "--endpoint grpc://HOST:PORT (the grpc_session arm) and/or --endpoint http://HOST:PORT "
        "(the http_* arms and the server's RSS)",
    )
    add_proposer(
        p,
        None,
        "the speculative arm's proposer; with --endpoint, the proposer every served request "
        "names (the server must serve it: checked once before the run)",
    )
    p.add_argument(
        "--draft-length", type=int, default=4, help="draft tokens per step of speculative decoding"
    )
    add_backend(p, None, "runtime of the in-process arms (default torch; mlx runs them on mlx-lm)")
    add_linear(p)
    add_cache(p, window=1020)
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
        "--prefill-tolerance",
        type=float,
        default=0.10,
        help="the prefill_bounded gate's tolerance: last vs first full bucket p50 of append "
        "latency, as a fraction (default 0.10)",
    )
    p.add_argument(
        "--prefill-direction",
        choices=("increase", "both"),
        default="increase",
        help="prefill_bounded fails on growth beyond the tolerance only (increase, the "
        "reference's default) or on a change either way (both)",
    )
    p.add_argument(
        "--max-errors",
        type=int,
        default=10,
        help="with --endpoint: a failing turn is recorded and counted; the run stops once more "
        "than this many failed (default 10)",
    )
    p.add_argument(
        "--restart-wait-s",
        type=float,
        default=120.0,
        help="with --endpoint: how long to wait for a server that went away before the turn "
        "counts as failed (its session is re-created when it is back)",
    )
    p.add_argument(
        "--force-new",
        action="store_true",
        help="start over in OUT_DIR instead of resuming its checkpoint",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_command)
    return p


def run_command(args: argparse.Namespace) -> int:
    """A long multi-turn run into OUT_DIR (checkpointed; re-running resumes)."""
    if args.endpoint:
        if args.backend is not None:
            raise UserError(
                "--backend is for in-process arms; with --endpoint the server's own --backend "
                "decides (drop --backend here)"
            )
        return run_served(args)
    if args.arms is None:
        args.arms = "sink_window,full_cache,reprefill"
    check_cache(args)
    settings = settings_from_args(args, arms=_names(args.arms))
    if settings.proposer is not None:
        check_proposer(settings.proposer)  # an unknown model or drafter before a model loads
    check_linear(args)
    out = check_out_dir(args.out_dir)
    check_model(args.model)
    if not args.force_new:
        check_resumable(args.model, settings, out)

    # torch from here on: once the cheap checks passed
    from kakeya_lab.bench.long_run import DegenerateRun, StoppedBeforeStart
    from kakeya_lab.experiments.long_run import failed_arms, outcome, record_long_run
    from kakeya_lab.models import load_model

    loaded = load_model(
        args.model, backend=settings.backend, linear=args.linear, progress=not args.quiet
    )
    try:
        run = record_long_run(
            loaded,
            settings,
            out,
            _invocation(args, settings),
            force_new=args.force_new,
            progress=not args.quiet,
        )
    except DegenerateRun as exc:
        message = " ".join(str(exc).split())
        print(f"{PROG}: run failed: {message} (checkpoint in {out})", file=sys.stderr)
        return EXIT_RUN_FAILED
    except StoppedBeforeStart as exc:
        print(f"{PROG}: {exc}; run again to resume", file=sys.stderr)
        return 128 + int(getattr(signal, exc.signal))
    print_summary(run.summary)
    if run.abort_reason is not None:
        rounds = int(run.turns["turn"].max()) + 1 if len(run.turns) else 0
        print(
            f"{PROG}: stopped by {run.abort_reason} after {rounds} round(s); partial report in "
            f"{out / 'metrics.json'}; run again to resume",
            file=sys.stderr,
        )
        return 128 + int(getattr(signal, run.abort_reason))
    if failed_arms(run.summary):
        print(f"{PROG}: {outcome(run)[1]}", file=sys.stderr)
        return EXIT_RUN_FAILED
    return 0


def check_resumable(model: str, settings: LongRunSettings, out: Path) -> None:
    """If ``out`` holds a checkpoint, refuse (a :class:`~kakeya_lab.resume.ResumeError`, exit
    2, nothing changed) unless it reads back whole and was made with these settings and
    this model — all before the model loads (its identity comes from its store folder)."""
    from kakeya_lab.bench.long_run.arms import arms_for
    from kakeya_lab.bench.long_run.identity import check_checkpoint, model_identity, saved_settings
    from kakeya_lab.bench.long_run.settings import CHECKPOINT

    path = out / CHECKPOINT
    if not path.exists():
        return
    from kakeya_lab.models.resolve import resolve

    found = resolve(model, pull_if_missing=False, progress=False)
    identity = model_identity(found.name, found.weight_sha256, settings.backend, settings.linear)
    now = saved_settings(identity, arms_for(settings), settings.user_turns(), settings)
    check_checkpoint(path, now)


def print_summary(summary: dict[str, dict]) -> None:
    """One line per arm (turns, errors, latency, both verdicts, drift), then how often
    each arm compared with a plain one replied the same."""
    for arm, s in summary.items():
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
            f"{(v.get('prefill_bounded') or {}).get('by_time')}{_gate(s)}  "
            f"prefill_flat_vs_history turns/time "
            f"{(v.get('prefill_flat_vs_history') or {}).get('by_turns')}/"
            f"{(v.get('prefill_flat_vs_history') or {}).get('by_time')}  append p50 drift {shown}"
            + _drafting(s)
            + (f"  stopped: {s['stopped']}" if s.get("stopped") else "")
        )
    for arm, s in summary.items():
        if "matches_plain" in s:
            m = s["matches_plain"]
            first = m["first_mismatch_turn"]
            print(
                f"{arm}: replies equal to {m['plain_arm']}'s on {m['turns_equal']} of "
                f"{m['turns_compared']} turns"
                + (f" (first mismatch: turn {first})" if first is not None else "")
            )


def _drafting(summary: dict) -> str:
    """``  accepted 2990/3015 (99.2%)``: a speculative arm's drafting, else empty."""
    spec = summary.get("speculation")
    if not spec:
        return ""
    return f"  accepted {spec['accepted']}/{spec['proposed']} ({spec['acceptance_rate']:.1%})"


def _gate(summary: dict) -> str:
    """`` (tolerance 10%, increase)``: the reference prefill gate's thresholds."""
    ref = (summary.get("gates") or {}).get("prefill_bounded") or {}
    if "tolerance" not in ref:
        return ""
    return f" (tolerance {ref['tolerance']:.0%}, {ref['direction']})"


def _names(arms: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in arms.split(",") if a.strip())


def settings_from_args(
    args: argparse.Namespace, arms: tuple[str, ...], served_arms: tuple[str, ...] = ()
) -> LongRunSettings:
    """The :class:`~kakeya_lab.bench.long_run.LongRunSettings` of this command line with
    these ``arms`` and ``served_arms``; a setting that cannot work is a :class:`UserError`
    naming its flag."""
    from kakeya_lab.bench.long_run.settings import LongRunSettings
    from kakeya_lab.settings import SettingsError

    if args.proposer is not None and "speculative" not in arms and not served_arms:
        raise UserError(
            "--proposer is for the speculative arm: add it, e.g. --arms sink_window,speculative"
        )
    if "speculative" in arms and args.proposer is None:
        raise UserError("the speculative arm needs --proposer, e.g. --proposer ngram")
    check_positive("--report-every-s", args.report_every_s, allow_zero=True)
    values = {
        "model": args.model,
        "backend": args.backend or "torch",
        "linear": linear_of(args),
        "sink": args.sink,
        "window": args.window,
        "positions": args.positions,
        "proposer": None if served_arms else args.proposer,
        "served_proposer": args.proposer if served_arms else None,
        "draft_length": args.draft_length,
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "duration_s": args.duration_s,
        "probe_every": args.probe_every,
        "checkpoint_every": args.checkpoint_every,
        "reprefill_cap_s": args.reprefill_cap_s,
        "turns_per_bucket": args.turns_per_bucket,
        "seconds_per_bucket": args.seconds_per_bucket,
        "turn_spacing_s": args.turn_spacing_s,
        "report_every_s": args.report_every_s or None,  # 0: by turns only
        "arms": arms,
        "served_arms": served_arms,
        "max_errors": args.max_errors,
        "prefill_tolerance": args.prefill_tolerance,
        "prefill_direction": args.prefill_direction,
    }
    try:
        return LongRunSettings(**values)
    except SettingsError as exc:
        flag = "--" + {"served_proposer": "proposer"}.get(exc.field, exc.field).replace("_", "-")
        if exc.field in ("arms", "served_arms"):
            raise UserError(f"--arms: {exc.problem}") from exc
        raise UserError(f"{flag} {exc.problem}") from exc


def _invocation(args: argparse.Namespace, settings: LongRunSettings) -> Invocation:
    """This command line, for the run folder's ``run.json``: its parameters are the run's
    settings (:meth:`LongRunSettings.to_dict`) and the options that are not settings."""
    from kakeya_lab.experiments.long_run import Invocation

    others = {k: getattr(args, k) for k in ("endpoint", "force_new", "quiet", "restart_wait_s")}
    return Invocation(
        command=[PROG, "long-run", *args.argv], parameters={**settings.to_dict(), **others}
    )


def run_served(args: argparse.Namespace) -> int:
    """``long-run --endpoint ...``: the served arms against a running ``kakeya-lab serve``,
    checkpointed and resumed like the in-process run. Everything is checked before the
    first turn: the arguments, the endpoints each arm needs, the server (reachable, the
    model asked for), the proposer (served), a checkpoint to resume (same settings, same
    server cache and model)."""
    from kakeya_lab.bench.long_run.served import (
        check_arms_reachable,
        check_served_arms,
        default_served_arms,
        parse_endpoints,
        probe_proposer,
        served_model_name,
        server_cache,
    )
    from kakeya_lab.bench.long_run.settings import CHECKPOINT, OUTPUTS

    try:
        endpoints = parse_endpoints(args.endpoint)
    except ValueError as exc:
        raise UserError(f"--endpoint: {exc}") from exc
    try:
        names = check_served_arms(
            _names(args.arms) if args.arms else default_served_arms(endpoints)
        )
        check_arms_reachable(names, endpoints)
    except ValueError as exc:
        raise UserError(f"--arms: {exc}") from exc
    check_positive("--restart-wait-s", args.restart_wait_s)
    settings = settings_from_args(args, arms=(), served_arms=tuple(names))
    out = check_out_dir(args.out_dir)
    resuming = not args.force_new and (out / CHECKPOINT).exists()
    if not args.force_new and not resuming and any((out / n).exists() for n in OUTPUTS):
        raise UserError(
            f"{out} holds a run without a checkpoint to resume: use another folder or --force-new"
        )
    check_model(args.model)
    from kakeya_lab.models.resolve import resolve

    found = resolve(args.model, pull_if_missing=False, progress=False)  # identity, no weights
    try:
        served_model = (
            served_model_name(endpoints.http_base)
            if endpoints.http_base is not None
            else found.name
        )
        cache = server_cache(endpoints)  # reachable, and answers as a session server
    except Exception as exc:  # an unreachable server is the user's to fix
        raise UserError(
            f"--endpoint: cannot reach the server ({type(exc).__name__}: {exc}); "
            "is `kakeya-lab serve` running there?"
        ) from exc
    if served_model != found.name:
        raise UserError(
            f"the server runs {served_model!r}, not --model {found.name!r}: pass --model {served_model}"
        )
    identity = {"name": found.name, "weight_sha256": found.weight_sha256}
    if resuming:
        from kakeya_lab.bench.long_run.identity import check_checkpoint
        from kakeya_lab.bench.long_run.served_driver import served_settings

        now = served_settings(
            identity, settings, settings.user_turns(), served_model=served_model, cache=cache
        )
        check_checkpoint(out / CHECKPOINT, now)  # ResumeError: exit 2, nothing changed
    if settings.served_proposer is not None:
        try:
            probe_proposer(endpoints, settings.served_proposer, settings.draft_length)
        except ValueError as exc:
            raise UserError(f"--proposer: {exc}") from exc
    from kakeya_lab.bench.long_run import StoppedBeforeStart
    from kakeya_lab.experiments.long_run import record_served_long_run, served_outcome

    try:
        served = record_served_long_run(
            endpoints,
            settings,
            out,
            _invocation(args, settings),
            model={**identity, "architecture": None, "random": False},
            log=None if args.quiet else (lambda line: print(line, flush=True)),
            force_new=args.force_new,
            restart_wait_s=args.restart_wait_s,
        )
    except StoppedBeforeStart as exc:
        print(f"{PROG}: {exc}; run again to resume", file=sys.stderr)
        return 128 + int(getattr(signal, exc.signal))
    print_summary(served.summary)
    if served.abort_reason == "max_errors":
        print(f"{PROG}: run failed: {served_outcome(served)[1]} (report in {out})", file=sys.stderr)
        return EXIT_RUN_FAILED
    if served.abort_reason is not None:
        rounds = int(served.turns["turn"].max()) + 1 if len(served.turns) else 0
        print(
            f"{PROG}: stopped by {served.abort_reason} after {rounds} round(s); partial report "
            f"in {out / 'metrics.json'}; run again to resume",
            file=sys.stderr,
        )
        return 128 + int(getattr(signal, served.abort_reason))
    return 0


def main(argv: Sequence[str]) -> int:
    """``kakeya-lab long-run ARGV``; returns the exit status."""
    parser = build_parser()
    parser.set_defaults(argv=list(argv))  # recorded in run.json
    return run_parser(parser, argv)
