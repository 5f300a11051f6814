"""A long run against a running ``kakeya-lab serve``: endpoints (or a loopback server started
for the run), the server's cache budget, the proposer probe, and the same summaries as the
in-process run (:mod:`~kakeya_lab.bench.long_run.served_driver` drives the rounds durably,
:mod:`~kakeya_lab.bench.long_run.served_turns` each turn through the clients,
:mod:`~kakeya_lab.bench.long_run.served_report` holds what a run produced)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kakeya_lab.bench.long_run.served_report import ServedRun
from kakeya_lab.bench.long_run.served_turns import ARMS, GRPC_ARMS, HTTP_ARMS
from kakeya_lab.bench.long_run.settings import SERVED_ARMS, LongRunSettings


@dataclass(frozen=True)
class Endpoints:
    """A server's addresses: ``grpc_target`` (``HOST:PORT``) and ``http_base``
    (``http://HOST:PORT``, no ``/v1``); either may be None (the arms that need it are
    then refused, :func:`check_arms_reachable`)."""

    grpc_target: str | None
    http_base: str | None


USAGE = (
    "give the server's addresses: --endpoint grpc://HOST:PORT and/or --endpoint http://HOST:PORT"
)


def parse_endpoints(values: Sequence[str]) -> Endpoints:
    """``grpc://HOST:PORT`` and/or ``http://HOST:PORT``, at most once each (gRPC serves the
    session arm; HTTP the OpenAI arms and the server's RSS). Raises ValueError saying
    what to write."""
    found: dict[str, str] = {}
    for value in values:
        parts = urlsplit(value)
        try:
            port = parts.port
        except ValueError:
            port = None
        if (
            parts.scheme not in ("grpc", "http")
            or not parts.hostname
            or port is None
            or port < 1
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
        ):
            raise ValueError(f"{value!r} is not grpc://HOST:PORT or http://HOST:PORT; {USAGE}")
        if parts.scheme in found:
            raise ValueError(
                f"two {parts.scheme} endpoints ({found[parts.scheme]}, {value}); {USAGE}"
            )
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        found[parts.scheme] = f"{host}:{port}"
    if not found:
        raise ValueError(f"no endpoint; {USAGE}")
    http = found.get("http")
    return Endpoints(grpc_target=found.get("grpc"), http_base=f"http://{http}" if http else None)


def check_arms_reachable(names: Sequence[str], endpoints: Endpoints) -> None:
    """ValueError (one line) for an arm whose endpoint was not given: ``grpc_session``
    needs ``grpc://``, the ``http_*`` arms ``http://``."""
    if endpoints.grpc_target is None and (need := [n for n in names if n in GRPC_ARMS]):
        raise ValueError(
            f"arm(s) {', '.join(need)} need a gRPC endpoint: add --endpoint grpc://HOST:PORT "
            f"or leave them out of --arms"
        )
    if endpoints.http_base is None and (need := [n for n in names if n in HTTP_ARMS]):
        raise ValueError(
            f"arm(s) {', '.join(need)} need an HTTP endpoint: add --endpoint http://HOST:PORT "
            f"or leave them out of --arms"
        )


def default_served_arms(endpoints: Endpoints) -> list[str]:
    """The served arms the given endpoints can drive (all three with both)."""
    return [
        *(GRPC_ARMS if endpoints.grpc_target else ()),
        *(HTTP_ARMS if endpoints.http_base else ()),
    ]


def check_served_arms(names: Sequence[str]) -> list[str]:
    """The served arms asked for (ValueError for unknown, repeated or none)."""
    names = list(names)
    unknown = sorted(set(names) - set(SERVED_ARMS))
    if unknown:
        raise ValueError(
            f"unknown served arm(s) {unknown} with --endpoint; known: {', '.join(SERVED_ARMS)}"
        )
    if not names:
        raise ValueError(f"no arms given; known with --endpoint: {', '.join(SERVED_ARMS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm is named twice in {names}")
    return names


def server_cache(endpoints: Endpoints | str) -> dict:
    """The server's cache figures (``sink``, ``budget_tokens``, ``kv_budget_bytes``; 0
    for a cache that never evicts), read from a session opened (with one token appended)
    and closed for it — over gRPC when ``endpoints`` has it (or is a gRPC target), else
    over HTTP (``/v1/sessions``)."""
    if isinstance(endpoints, str):
        endpoints = Endpoints(grpc_target=endpoints, http_base=None)
    if endpoints.grpc_target is not None:
        from kakeya_lab.serve.client import SessionClient

        with SessionClient(endpoints.grpc_target, timeout_s=600) as client:
            sid = client.create()
            try:
                # one token, so the cache has allocated its storage: an empty session's
                # kv_budget_bytes is 0 (the cache does not know its dtype yet)
                client.append_ids(sid, [0])
                reply = client.info(sid)
            finally:
                client.close_session(sid)
        figures = {k: getattr(reply, k) for k in ("sink", "budget_tokens", "kv_budget_bytes")}
    else:
        info = _http_cache(str(endpoints.http_base))
        figures = {k: info[k] for k in ("sink", "budget_tokens", "kv_budget_bytes")}
    return {k: int(v) for k, v in figures.items()}


def _http_cache(http_base: str) -> dict:
    import httpx

    from kakeya_lab.serve.api_keys import auth_headers

    headers = auth_headers()
    with httpx.Client(base_url=http_base, timeout=600, headers=headers) as http:
        created = http.post("/v1/sessions")
        created.raise_for_status()
        sid = created.json()["session_id"]
        try:
            # one token (as over gRPC): a chat turn of one generated token on the session
            http.post(
                "/v1/chat/completions",
                json={
                    "model": served_model_name(http_base),
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 1,
                    "session_id": sid,
                },
            ).raise_for_status()
            info = http.get(f"/v1/sessions/{sid}")
            info.raise_for_status()
        finally:
            http.delete(f"/v1/sessions/{sid}")
    return info.json()


def served_model_name(http_base: str) -> str:
    """The model the server at ``http_base`` serves (``/v1/models``)."""
    import httpx

    from kakeya_lab.serve.api_keys import auth_headers

    reply = httpx.get(f"{http_base}/v1/models", timeout=30, headers=auth_headers())
    reply.raise_for_status()
    return str(reply.json()["data"][0]["id"])


def probe_proposer(endpoints: Endpoints, proposer: str, draft_length: int) -> None:
    """Ask the server once whether it serves ``proposer`` (one generated token on a
    throwaway session, over every endpoint given); ValueError with the server's own
    one-line message when it refuses."""
    if endpoints.grpc_target is not None:
        import grpc

        from kakeya_lab.serve.client import SessionClient

        with SessionClient(endpoints.grpc_target, timeout_s=600) as client:
            sid = client.create()
            try:
                client.append_ids(sid, [0])
                client.generate(sid, 1, proposer=proposer, draft_length=draft_length)
            except grpc.RpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    raise ValueError(
                        f"the server refuses proposer {proposer!r}: {exc.details()}"
                    ) from None
                raise
            finally:
                client.close_session(sid)
    if endpoints.http_base is not None:
        import httpx

        from kakeya_lab.serve.api_keys import auth_headers

        reply = httpx.post(
            f"{endpoints.http_base}/v1/chat/completions",
            json={
                "model": served_model_name(endpoints.http_base),
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
                "reuse": False,
                "proposer": proposer,
                "draft_length": draft_length,
            },
            timeout=600,
            headers=auth_headers(),
        )
        if 400 <= reply.status_code < 500:
            try:
                message = reply.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = reply.text
            raise ValueError(f"the server refuses proposer {proposer!r}: {message}")
        reply.raise_for_status()


SERVE_HERE = "serve"


def endpoint_values(endpoint: str | Sequence[str]) -> list[str]:
    """The addresses in a notebook's ``endpoint`` parameter: a string holding one or both
    (``"grpc://HOST:P http://HOST:Q"``, separated by spaces or commas) or a list."""
    values = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    return [v for value in values for v in value.replace(",", " ").split() if v]


@contextmanager
def served_endpoints(
    endpoint: str | Sequence[str],
    *,
    model: str,
    sink: int,
    window: int,
    backend: str = "torch",
    linear: str | None = None,
    timeout_s: float = 300.0,
) -> Iterator[Endpoints | None]:
    """The server a long run drives, for as long as the ``with`` block runs.

    ``endpoint`` empty: ``None`` (no served arms). ``"serve"``: a ``kakeya-lab serve`` of
    ``model`` with a ``sink`` + ``window`` cache on ``backend`` (a torch server's linear
    kernel ``linear``, None: the server's default), started on free loopback ports (ready
    within ``timeout_s``) and stopped (SIGTERM) when the block ends. Otherwise the
    addresses of a running server (:func:`endpoint_values`, :func:`parse_endpoints`;
    ValueError saying what to write)."""
    values = endpoint_values(endpoint)
    if not values:
        yield None
        return
    if values != [SERVE_HERE]:
        yield parse_endpoints(values)
        return
    from kakeya_lab.serve.process import start_server

    kernel = ["--linear", linear] if linear is not None and backend == "torch" else []
    server = start_server(
        "--sink", str(sink), "--window", str(window), "--backend", backend, *kernel,
        model=model, timeout_s=timeout_s,
    )  # fmt: skip
    try:
        yield Endpoints(grpc_target=server.grpc_target, http_base=server.http_base)
    finally:
        server.stop(timeout_s=30)


def run_served(
    endpoints: Endpoints,
    settings: LongRunSettings,
    user_turns: Sequence[str] | None = None,
    *,
    model: str | None = None,
    log: Callable[[str], None] | None = None,
    out_dir: str | Path | None = None,
    on_report: Callable[[ServedRun], None] | None = None,
    catch_signals: bool = True,
    force_new: bool = False,
    on_start: Callable[[], None] | None = None,
    restart_wait_s: float = 120.0,
    model_identity: Mapping[str, Any] | None = None,
) -> ServedRun:
    """Drive ``user_turns`` (default: the standard script of ``settings.turns`` turns,
    cycled while ``settings.duration_s`` lasts) through the server at ``endpoints`` with
    ``settings.served_arms`` (:func:`~kakeya_lab.bench.long_run.served_driver.drive_served`:
    checkpointed into ``out_dir`` every ``settings.checkpoint_every`` rounds and
    ``settings.report_every_s`` seconds, each time calling ``on_report`` with a partial
    run; resumed from its checkpoint with the same settings, server and model; stopped by
    SIGTERM/SIGINT with a final partial report; failing turns recorded and counted up to
    ``settings.max_errors``; a server restart waited for up to ``restart_wait_s``).

    ``model``: the name the server must serve (ValueError if it serves another, or if no
    served arm is asked for); its tokenizer, from the local store, mirrors the gRPC arm's
    conversation. ``model_identity``: what the checkpoint records of it (default: its
    store name and weight hash)."""
    from kakeya_lab.bench.long_run.served_driver import drive_served

    if not settings.served_arms:
        raise ValueError("run_served: settings.served_arms names no arm")
    check_arms_reachable(settings.served_arms, endpoints)
    turns = settings.user_turns() if user_turns is None else list(user_turns)
    if len(turns) != settings.turns:
        raise ValueError(
            f"{len(turns)} user turns given for settings.turns={settings.turns}: give as many"
        )
    served_model = (
        served_model_name(endpoints.http_base)
        if endpoints.http_base is not None
        else (model or settings.model)
    )
    if model is not None and served_model != model:
        raise ValueError(f"the server runs {served_model!r}, not {model!r}")
    cache = server_cache(endpoints)
    identity = dict(model_identity) if model_identity is not None else None
    tokenizer = None
    if "grpc_session" in settings.served_arms or identity is None:
        from kakeya_lab.models.resolve import resolve

        found = resolve(served_model, pull_if_missing=False, progress=False)
        if identity is None:
            identity = {"name": found.name, "weight_sha256": found.weight_sha256}
        if "grpc_session" in settings.served_arms:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(found.folder), local_files_only=True)
    return drive_served(
        endpoints,
        settings,
        turns,
        served_model=served_model,
        cache=cache,
        model_identity=identity,
        tokenizer=tokenizer,
        out_dir=out_dir,
        on_report=on_report,
        catch_signals=catch_signals,
        force_new=force_new,
        on_start=on_start,
        log=log,
        restart_wait_s=restart_wait_s,
    )


def run_served_long_run(
    grpc_target: str | None,
    http_base: str | None,
    user_turns: Sequence[str],
    *,
    max_new_tokens: int = 32,
    model: str | None = None,
    arms: Sequence[str] = ARMS,
    turn_spacing_s: float | None = None,
    duration_s: float | None = None,
    stateless_cap_s: float | None = None,
    log: Callable[[str], None] | None = None,
):
    """Drive ``user_turns`` through the server once, in memory (no checkpoint, no report):
    one row per (arm, turn) as a DataFrame. ``http_base`` is ``http://HOST:PORT`` (no
    ``/v1``); either address may be None when no arm needs it. ``turn_spacing_s``: round
    ``i`` starts ``i * turn_spacing_s`` seconds after the start; ``duration_s``: no round
    starts after this much wall time (the turns are cycled until then);
    ``stateless_cap_s``: the ``http_stateless`` arm stops after its first slower request.
    ``model``: the model name (default: the server's; its tokenizer serves the gRPC arm's
    mirror). The durable run is :func:`kakeya_lab.bench.long_run.served.run_served`."""
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown served arm(s) {sorted(unknown)}: use {', '.join(ARMS)}")
    for name, value in (
        ("turn_spacing_s", turn_spacing_s),
        ("duration_s", duration_s),
        ("stateless_cap_s", stateless_cap_s),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 (got {value})")
    endpoints = Endpoints(grpc_target=grpc_target, http_base=http_base)
    settings = LongRunSettings(
        model=model or LongRunSettings.model,
        arms=(),
        served_arms=tuple(arms),
        turns=len(user_turns),
        max_new_tokens=max_new_tokens,
        turn_spacing_s=turn_spacing_s,
        duration_s=duration_s,
        reprefill_cap_s=stateless_cap_s,
        max_errors=0,
    )
    served = run_served(
        endpoints, settings, list(user_turns), model=model, log=log, catch_signals=False
    )
    if served.abort_reason is not None:
        raise RuntimeError(f"the served run stopped: {served.abort_reason}")
    return served.turns
