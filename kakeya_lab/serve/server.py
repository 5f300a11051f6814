"""Run the gRPC service and the HTTP endpoint in one process over one store.

:func:`run_server` starts both on loopback (by default), prints one progress line when
ready, waits for SIGTERM/SIGINT, then shuts down: new work is refused, active streams end
with a clear status (gRPC ``UNAVAILABLE``, an in-band HTTP error event), both servers
stop and the process exits 0. Sessions live in memory only: after a restart every old
session id is reported unknown (``NOT_FOUND`` / 404), never silently reset.

Exposure: with ``api_keys`` every call but ``GET /health`` needs one of them; a
non-loopback ``host`` is refused without a key; HTTP requests must name this server in
their Host header and carry no Origin header but an allowed one (:mod:`~kakeya_lab.serve.guard`).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import uvicorn

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.thread_pool import release_thread_pool
from kakeya_lab.linear import kernel_description
from kakeya_lab.serve.admission import Admission
from kakeya_lab.serve.api_keys import ApiKeys
from kakeya_lab.serve.grpc_service import start_grpc_server
from kakeya_lab.serve.guard import HostCheck
from kakeya_lab.serve.http_app import create_app
from kakeya_lab.serve.served_proposers import ServedProposers
from kakeya_lab.serve.sessions import ServedSessions, ServeLimits
from kakeya_lab.session import SessionStore


@dataclass(frozen=True)
class ServeOptions:
    """Where and how to serve. Port 0 picks a free port (printed in the progress line).

    ``admission``: ``reject`` / ``queue`` (wait up to ``max_wait_s``, 0: without limit; at
    most ``max_queued`` callers at once) when all ``capacity`` slots are used, or
    ``evict_lru`` (the least recently used idle session is closed). ``drafts``: the
    ``draft:MODEL[:KERNEL]`` and ``drafter:NAME`` specs loaded once at startup, which requests may then name as
    their proposer (``draft_window``: their caches' window; None: the cache's). ``idle_ttl_s`` closes any session idle
    that long, ``implicit_ttl_s`` the implicit ones (stateless HTTP requests'; None: never).
    ``api_keys``: the accepted keys (empty: open to every caller, loopback only);
    ``allowed_hosts`` / ``allowed_origins``: HTTP Host names and Origins accepted besides
    this server's own address. ``batch``: concurrent sessions' steps share forwards
    (:class:`~kakeya_lab.session.store.SessionStore`'s ``batch``: None, the default, where
    the model allows it; True requires it; False turns it off)."""

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    capacity: int = 8
    admission: str = "reject"
    max_wait_s: float = 10.0
    idle_ttl_s: float | None = None
    implicit_ttl_s: float | None = 600.0
    max_queued: int = 8
    limits: ServeLimits = ServeLimits()
    shutdown_grace_s: float = 5.0
    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    drafts: tuple[str, ...] = ()
    draft_window: int | None = None
    batch: bool | None = None

    def __repr__(self) -> str:  # never print the keys
        return f"ServeOptions(host={self.host!r}, keys={len(self.api_keys)}, ...)"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address) is a loopback address."""
    return ipaddress.ip_address(host).is_loopback


def build_served(loaded, cache: SinkWindowConfig, options: ServeOptions) -> ServedSessions:
    """The serving layer over a fresh store for ``loaded`` (a :class:`LoadedModel`), with
    the draft models of ``options.drafts`` loaded (once each)."""
    # the store rejects when full; the serving layer evicts (only idle sessions, counted)
    store = SessionStore(
        loaded.model,
        cache,
        capacity=options.capacity,
        idle_ttl_s=options.idle_ttl_s,
        batch=options.batch,
    )
    # waiters also wake when an idle TTL is due (ServedSessions sets next_expiry)
    admission = Admission(
        "queue" if options.admission == "queue" else "reject",
        options.max_wait_s,
        max_waiting=options.max_queued,
    )
    proposers = ServedProposers.load(
        options.drafts,
        loaded.model,
        cache,
        loaded.tokenizer,
        verifier_sha256=loaded.description.weight_sha256,
        draft_window=options.draft_window,
    )
    return ServedSessions(
        store,
        loaded.tokenizer,
        admission,
        options.limits,
        model_name=loaded.description.name,
        verifier_sha256=loaded.description.weight_sha256,
        evict_lru=options.admission == "evict_lru",
        implicit_ttl_s=options.implicit_ttl_s,
        proposers=proposers,
    )


def kernel_line(model) -> str:
    """``linear KERNEL; `` for the ready line (a torch model); empty on another backend."""
    return f"linear {kernel_description(model)}; " if isinstance(model, torch.nn.Module) else ""


def run_server(
    loaded, cache: SinkWindowConfig, options: ServeOptions, *, prog: str = "kakeya-lab serve"
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (0 after a clean shutdown).
    ValueError for a non-loopback ``host`` without an API key."""
    if not options.api_keys and not is_loopback(options.host):
        raise ValueError(
            f"--host {options.host} serves other machines: give an API key "
            "(--api-key-file PATH or $KAKEYA_LAB_API_KEY), or bind 127.0.0.1"
        )
    keys = ApiKeys(options.api_keys)
    served = build_served(loaded, cache, options)
    served.store.warm_up()  # the first client waits for nothing, the footprint is steady
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    grpc_server, grpc_port = start_grpc_server(served, options.host, options.grpc_port, keys=keys)
    sock = socket.socket(
        socket.AF_INET6 if ":" in options.host else socket.AF_INET, socket.SOCK_STREAM
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((options.host, options.http_port))
    except OSError as exc:
        grpc_server.stop(0)
        raise OSError(
            f"cannot bind the HTTP port {options.host}:{options.http_port}: {exc}"
        ) from exc
    http_port = sock.getsockname()[1]
    http = uvicorn.Server(
        uvicorn.Config(
            create_app(
                served,
                keys=keys,
                hosts=HostCheck(options.host, options.allowed_hosts),
                allowed_origins=options.allowed_origins,
            ),
            log_level="warning",
            lifespan="off",
            # uvicorn annotates int, but uses it as asyncio.wait_for seconds (floats work)
            timeout_graceful_shutdown=options.shutdown_grace_s,  # type: ignore[arg-type]
        )
    )
    http_thread = threading.Thread(
        target=http.run, kwargs={"sockets": [sock]}, name="http", daemon=True
    )
    http_thread.start()
    deadline = time.monotonic() + 30
    while not http.started and http_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not http.started:
        grpc_server.stop(0)
        raise RuntimeError("the HTTP server did not start (see the log above)")

    d = loaded.description
    budget = cache.budget if cache.budget is not None else "unbounded"
    print(
        f"{prog}: ready: model {d.name} (weights sha256 {d.weight_sha256[:16]}, {getattr(d, 'backend', 'torch')}, {d.dtype}); "
        f"cache sink {cache.sink} window {cache.window} ({budget} tokens, {cache.positions} positions); "
        f"capacity {options.capacity} ({options.admission}); "
        f"batched steps {'on' if served.store.batcher is not None else 'off'}; "
        f"{kernel_line(loaded.model)}"
        f"proposers: model-free{''.join(', ' + d for d in served.proposers.loaded())}; "
        f"{'API key required' if keys.required else 'no API key (loopback only)'}; "
        f"gRPC {options.host}:{grpc_port}; HTTP http://{options.host}:{http_port}/v1",
        flush=True,
    )

    # the sessions' threads compute from here on: this thread's OpenMP pool (from loading
    # the model) would slow every one of their steps (backends/thread_pool.py)
    release_thread_pool()
    stop.wait()
    print(f"{prog}: stopping: ending active streams", file=sys.stderr, flush=True)
    served.shutdown()  # streams end at their next token; queued creations are refused now
    grpc_server.stop(grace=options.shutdown_grace_s).wait()
    http.should_exit = True
    http_thread.join(timeout=options.shutdown_grace_s + 5)
    left = len(served.store)
    print(
        f"{prog}: stopped ({left} session(s) dropped with the process)", file=sys.stderr, flush=True
    )
    return 0
