"""``kakeya-lab chat``: interactive multi-turn chat on one session, with a live
cache/latency line after every reply (``/info`` prints the session, ``/quit`` ends)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kakeya_lab.cli_args import (
    PROG,
    Parser,
    UserError,
    add_cache,
    add_draft_options,
    add_linear,
    add_model,
    add_proposer,
    add_proposer_modules,
    cache_config,
    check_cache,
    check_int,
    check_linear,
    check_model,
    check_proposer,
    check_sampling,
    load_proposer_modules,
    run_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab chat`` parser."""
    p = Parser(prog=f"{PROG} chat", description="Interactive multi-turn chat on one session.")
    add_model(p)
    add_cache(p, window=1020)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt")
    add_proposer_modules(p)
    add_proposer(
        p,
        "none",
        "speculative decoding (drafter:NAME: a named drafter, see `kakeya-lab align list`; a "
        "draft model's KERNEL int8 or int4 gives it quantised weights, cheaper steps that change "
        "only how many drafts are accepted, never the output)",
    )
    p.add_argument(
        "--draft-length",
        type=int,
        default=4,
        help="tokens drafted per verifier forward (speculative decoding)",
    )
    add_linear(p, default="auto")
    add_draft_options(p)
    p.set_defaults(func=run_chat)
    return p


def run_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat on one session, with a live cache/latency line."""
    check_cache(args)
    check_int("--max-new-tokens", args.max_new_tokens, 1)
    check_int("--draft-length", args.draft_length, 1)
    check_sampling(args)
    load_proposer_modules(args)
    check_proposer(args.proposer)
    check_linear(args)
    check_model(args.model)
    config = cache_config(args)

    from kakeya_lab.chat import ChatTemplate  # the heavy imports, once every argument is fine
    from kakeya_lab.linear import kernel_description
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

    loaded = load_model(args.model, linear=args.linear)
    tok = loaded.tokenizer
    store = SessionStore(loaded.model, config, capacity=1)
    store.warm_up()  # the first turn's tok/s is then the steady one
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
        f"{config.positions} positions, linear {kernel_description(loaded.model)}, "
        f"proposer {args.proposer}. /info, /quit.",
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


def main(argv: Sequence[str]) -> int:
    """``kakeya-lab chat ARGV``; returns the exit status."""
    return run_parser(build_parser(), argv)
