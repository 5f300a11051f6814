"""``kakeya-lab serve``: one model's sessions over gRPC and an OpenAI-compatible HTTP
endpoint in one process, until SIGTERM."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kakeya_lab.cli_args import (
    PROG,
    Parser,
    UserError,
    add_backend,
    add_cache,
    add_linear,
    add_model,
    add_proposer_modules,
    cache_config,
    check_cache,
    check_int,
    check_linear,
    check_model,
    load_proposer_modules,
    run_parser,
)

if TYPE_CHECKING:
    from kakeya_lab.backends.config import SinkWindowConfig
    from kakeya_lab.serve.server import ServeOptions


def build_parser() -> argparse.ArgumentParser:
    """The ``kakeya-lab serve`` parser."""
    p = Parser(
        prog=f"{PROG} serve",
        description="Serve one model's sessions over gRPC (CreateSession, AppendTokens, Generate, "
        "GetSessionInfo, CloseSession) and an OpenAI-compatible HTTP endpoint (/v1/chat/completions, "
        "/v1/models, /v1/proposers, /health, /metrics) in one process. Port 0 picks a free port; the ready line "
        "names both. SIGTERM ends active streams with a clear status and exits 0.",
    )
    add_model(p)
    add_backend(p, "torch")
    add_linear(p, default="auto")
    add_cache(p, window=1020)
    p.add_argument("--capacity", type=int, default=8, help="open sessions at most")
    p.add_argument(
        "--admission",
        choices=["reject", "queue", "evict_lru"],
        default="reject",
        help="when full: reject (RESOURCE_EXHAUSTED / 429 at once), queue (wait for a slot: "
        "up to --max-wait-s; queued callers are woken by a close, an eviction or an idle "
        "expiry, and refused with UNAVAILABLE / 503 at shutdown), or close the least recently "
        "used idle session",
    )
    p.add_argument(
        "--max-wait-s",
        type=float,
        default=10.0,
        help="queue admission: longest wait in seconds; 0: wait without limit",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=8,
        help="queue admission: callers waiting at once (more are refused at once; 0..16)",
    )
    p.add_argument(
        "--idle-ttl-s", type=float, default=None, help="close any session idle this long"
    )
    p.add_argument(
        "--implicit-ttl-s",
        type=float,
        default=600.0,
        help="close implicit sessions (those of stateless HTTP requests) idle this long; 0: never",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; anything but loopback needs an API key",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="accepted API keys, one a line (also $KAKEYA_LAB_API_KEY); clients send "
        "'Authorization: Bearer KEY' (HTTP header, gRPC metadata). Keys are never taken on "
        "the command line, where other users see them",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="an HTTP Host name to accept besides this server's address (repeatable)",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (scheme://host[:port]) whose pages may call the server (repeatable)",
    )
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--max-append-tokens", type=int, default=8192, help="largest single append")
    p.add_argument("--max-new-tokens-limit", type=int, default=2048, help="largest max_new_tokens")
    p.add_argument(
        "--draft",
        action="append",
        default=[],
        metavar="draft:MODEL[:KERNEL]|drafter:NAME",
        help="load this draft model or named drafter once at startup (repeatable): requests "
        "may then name it as their proposer (gRPC proposer, HTTP proposer and draft_length), "
        "each session with its own draft cache or hidden-state trace over the shared weights, "
        "e.g. draft:smollm2-135m-instruct:int4; drafter:NAME also serves drafter-tree:NAME; "
        "model-free proposers need no loading",
    )
    p.add_argument(
        "--draft-window",
        dest="served_draft_window",
        metavar="N",
        type=int,
        default=None,
        help="the draft models' own cache window (default: --window)",
    )
    p.add_argument(
        "--batch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the steps of concurrently generating sessions in shared forwards "
        "(continuous batching); default: on wherever the model allows it (torch Llama and "
        "Qwen models of linear layers), --batch to require it, --no-batch to turn it off",
    )
    add_proposer_modules(p)
    p.set_defaults(func=run_serve)
    return p


def check_serve_arguments(args: argparse.Namespace) -> None:
    """Check every ``serve`` argument, cheaply (nothing heavy is imported)."""
    import ipaddress

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
    from kakeya_lab.serve.api_keys import read_keys

    try:
        args.api_keys = tuple(read_keys(args.api_key_file))
    except ValueError as exc:
        raise UserError(f"--api-key-file: {exc}") from None
    if not args.api_keys and not ipaddress.ip_address(args.host).is_loopback:
        raise UserError(
            f"--host {args.host} serves other machines: give an API key "
            "(--api-key-file PATH or $KAKEYA_LAB_API_KEY), or bind 127.0.0.1"
        )
    checks = [
        (args.capacity >= 1, f"--capacity must be >= 1, got {args.capacity}"),
        (0 <= args.max_queued <= 16, f"--max-queued must be in 0..16, got {args.max_queued}"),
        (args.implicit_ttl_s >= 0, f"--implicit-ttl-s must be >= 0, got {args.implicit_ttl_s}"),
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
    if args.batch and args.backend != "torch":
        raise UserError(f"--batch runs on the torch backend only, not {args.backend}: drop --batch")
    check_cache(args)
    check_linear(args)
    load_proposer_modules(args)
    check_drafts(args)


def check_drafts(args: argparse.Namespace) -> None:
    """``--draft`` (one ``draft:MODEL[:KERNEL]`` or ``drafter:NAME`` each, the model or
    drafter found without loading it) and ``--draft-window``."""
    from kakeya_lab.proposers.builtin import draft_model_spec
    from kakeya_lab.proposers.drafters.named import read_record
    from kakeya_lab.serve.served_proposers import check_draft_flag

    for spec in args.draft:
        try:
            kind, argument = check_draft_flag(spec)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if kind == "drafter":
            try:
                read_record(argument)  # a name the store does not hold: listed, one line
            except ValueError as exc:
                raise UserError(f"--draft {spec}: {exc}") from None
            if args.backend != "torch":
                raise UserError(
                    f"--draft {spec}: a named drafter reads the verifier's hidden states, "
                    f"which only the torch backend records, not {args.backend}"
                )
            continue
        name, kernel = draft_model_spec(argument)
        if kernel and args.backend != "torch":
            raise UserError(
                f"--draft {spec}: a draft model's kernel is a torch kernel; "
                f"the {args.backend} backend has its own"
            )
        check_model(name, "--draft draft:")
    if args.served_draft_window is not None:
        if not args.draft:
            raise UserError(
                f"--draft-window {args.served_draft_window} needs a --draft draft:MODEL"
            )
        check_int("--draft-window", args.served_draft_window, 1)


def serve_options(args: argparse.Namespace) -> tuple[SinkWindowConfig, ServeOptions]:
    """The cache and server options of checked arguments."""
    cache = cache_config(args)
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
        implicit_ttl_s=args.implicit_ttl_s or None,
        max_queued=args.max_queued,
        api_keys=args.api_keys,
        allowed_hosts=tuple(args.allowed_host),
        allowed_origins=tuple(args.allowed_origin),
        batch=args.batch,
        limits=ServeLimits(
            max_append_tokens=args.max_append_tokens, max_new_tokens=args.max_new_tokens_limit
        ),
        drafts=tuple(args.draft),
        draft_window=args.served_draft_window,
    )
    return cache, options


def run_serve(args: argparse.Namespace) -> int:
    """Serve sessions over gRPC and an OpenAI-compatible HTTP endpoint until SIGTERM."""
    check_serve_arguments(args)
    cache, options = serve_options(args)
    from kakeya_lab.models import load_model
    from kakeya_lab.serve.memory import limit_arenas

    limit_arenas()  # before the model's and the server's threads exist (see serve/memory.py)

    print(f"{PROG} serve: loading {args.model} ({args.backend})", file=sys.stderr, flush=True)
    loaded = load_model(args.model, backend=args.backend, linear=args.linear, progress=False)
    for spec in args.draft:
        print(
            f"{PROG} serve: loading {spec} (shared by every session)", file=sys.stderr, flush=True
        )
    from kakeya_lab.serve.server import run_server

    try:
        return run_server(loaded, cache, options, prog=f"{PROG} serve")
    except (OSError, ValueError) as exc:  # a port in use; a draft model that cannot draft
        raise UserError(str(exc)) from exc


def main(argv: Sequence[str]) -> int:
    """``kakeya-lab serve ARGV``; returns the exit status."""
    return run_parser(build_parser(), argv)
