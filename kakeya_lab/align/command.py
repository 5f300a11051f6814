"""``kakeya-lab align``: capture verifier rollouts, train a drafter on them and keep it as
a named drafter (``--proposer drafter:NAME``), list the named drafters."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from kakeya_lab.cli_args import (
    PROG,
    Parser,
    UserError,
    add_cache,
    add_model,
    cache_config,
    check_cache,
    check_int,
    check_model,
    check_out_dir,
    check_positive,
    run_parser,
    table,
    usage,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab align`` parser: ``capture``, ``train`` and ``list``."""
    align = Parser(
        prog=f"{PROG} align",
        description="Proposer alignment: verifier rollouts, drafter training, named drafters.",
    )
    sub = align.add_subparsers(dest="align_command", metavar="ALIGN_COMMAND")
    align.set_defaults(func=lambda _args: usage(align))
    p = sub.add_parser("capture", help="capture verifier rollouts into a datasets folder")
    p.add_argument("out_dir")
    add_model(p)
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
    add_cache(p, window=252, positions=False)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_capture)

    p = sub.add_parser(
        "train",
        help="capture, train and evaluate a drafter; save it as a named drafter",
        description="Capture (or resume/reuse) verifier rollouts of one domain, train a drafter "
        "on them with held-out evaluation, and save it in the store as NAME (then "
        "`--proposer drafter:NAME`). Interrupted runs resume; NAME appears only when finished.",
    )
    p.add_argument("name", metavar="NAME", help="drafter name, e.g. smollm2-feature")
    add_model(p, "--verifier", help="the model it drafts for")
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
    add_cache(p, window=252, positions=False)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run_train)

    p = sub.add_parser("list", help="list the named drafters")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.set_defaults(func=run_list)
    return align


def run_capture(args: argparse.Namespace) -> int:
    """Capture verifier rollouts of one domain and split into OUT_DIR (resumable)."""
    check_cache(args)
    for flag, value in (
        ("--conversations", args.conversations),
        ("--turns", args.turns),
        ("--max-new-tokens", args.max_new_tokens),
        ("--top-k", args.top_k),
        ("--shard-size", args.shard_size),
    ):
        check_int(flag, value, 1)
    if args.min_confidence is not None and not 0.0 < args.min_confidence <= 1.0:
        raise UserError(f"--min-confidence must be in (0, 1], got {args.min_confidence}")
    check_out_dir(args.out_dir)
    check_model(args.model)
    config = cache_config(args)

    from kakeya_lab.align.rollouts import CaptureOptions, capture_rollouts
    from kakeya_lab.data import domain_conversations
    from kakeya_lab.models import load_model

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


def run_train(args: argparse.Namespace) -> int:
    """``kakeya-lab align train NAME``: capture (or reuse) rollouts, train a drafter with
    held-out evaluation and save it as a named drafter (resumable; nothing under NAME
    until it is finished)."""
    check_cache(args)
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
        check_int(flag, value, 1)
    check_int("--teacher-conversations", args.teacher_conversations, 0)
    check_positive("--lr", args.lr)
    if args.work_dir is not None:
        check_out_dir(args.work_dir, "--work-dir")
    check_model(args.verifier, "--verifier")

    from kakeya_lab.align.recipe import AlignRecipe, align_named_drafter
    from kakeya_lab.models import load_model
    from kakeya_lab.proposers.drafters.named import (  # torch: after the cheap checks
        check_name,
        drafters_home,
    )

    try:
        check_name(args.name)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if (drafters_home() / args.name).exists() and not args.overwrite:
        raise UserError(
            f"a drafter named {args.name!r} exists in {drafters_home()}: choose another name "
            "or pass --overwrite"
        )
    config = cache_config(args)
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


def run_list(args: argparse.Namespace) -> int:
    """``kakeya-lab align list``: the named drafters (complete ones only)."""
    from kakeya_lab.proposers.drafters.named import drafters_home, list_drafters

    rows = list_drafters()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no named drafters in {drafters_home()}; make one with `{PROG} align train NAME`")
        return 0

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    cells = [
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
    print(table(cells, [*header, "held-out loss", "held-out tau"]))
    print(f"\nDrafters: {drafters_home()}  (set KAKEYA_LAB_DRAFTERS to move them)")
    return 0


def main(argv: Sequence[str]) -> int:
    """``kakeya-lab align ARGV``; returns the exit status."""
    return run_parser(build_parser(), argv)
