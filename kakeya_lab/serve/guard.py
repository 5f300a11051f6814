"""Who may talk to a server: the HTTP Host, Origin and API key checks, the gRPC key check.

* the keys and owners are :mod:`kakeya_lab.serve.api_keys`'s;
* :class:`HttpGuard` — ASGI middleware: refuses a Host header that does not name this
  server (DNS rebinding), any Origin header not allowed (a web page on another site; no
  CORS), and a missing or wrong key on every route but ``/health``. The caller's owner is
  put in the request's state (:func:`owner_of`).
* :class:`GrpcAuth` — a gRPC server interceptor: every call without a valid key ends with
  ``UNAUTHENTICATED``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse

from kakeya_lab.serve.api_keys import ANONYMOUS, ApiKeys

OWNER_STATE = "kakeya_owner"  # the request-state attribute HttpGuard sets


def _host_name(value: str) -> str:
    """The host of a ``host[:port]`` value (IPv6 literals in brackets), lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class HostCheck:
    """Which Host names reach this server: loopback names, the bind address and the
    ``allowed`` names; any IP literal too when the server binds every address."""

    LOOPBACK = ("localhost", "127.0.0.1", "::1")

    def __init__(self, bind_host: str, allowed: Sequence[str] = ()):
        self.names = {*self.LOOPBACK, bind_host.lower(), *(_host_name(a) for a in allowed)}
        try:
            self.any_ip = ipaddress.ip_address(bind_host).is_unspecified
        except ValueError:  # a host name (e.g. "localhost"), not an address
            self.any_ip = False

    def ok(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        name = _host_name(host_header)
        if name in self.names:
            return True
        if self.any_ip:  # an IP literal cannot be a rebound DNS name
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False


def _error(status: int, message: str, kind: str, code: str) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


class HttpGuard:
    """Pure ASGI middleware (see the module docstring); ``on_refuse(status)`` counts refusals."""

    OPEN_PATHS = ("/health",)

    def __init__(
        self,
        app,
        *,
        keys: ApiKeys,
        hosts: HostCheck,
        allowed_origins: Sequence[str] = (),
        on_refuse=lambda status: None,
    ):
        self.app = app
        self.keys = keys
        self.hosts = hosts
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal, owner = self._check(scope.get("path", ""), headers)
        if refusal is not None:
            self.on_refuse(refusal.status_code)
            await refusal(scope, receive, send)
            return
        if owner is not None:
            scope.setdefault("state", {})[OWNER_STATE] = owner
        await self.app(scope, receive, send)

    def _check(self, path: str, headers: dict[str, str]) -> tuple[JSONResponse | None, str | None]:
        """(a refusal, None) or (None, the caller's owner; None on an open path)."""
        if not self.hosts.ok(headers.get("host")):
            return _error(
                400,
                f"Host {headers.get('host', '')!r} does not name this server: connect to its "
                "address (or start it with --allowed-host NAME)",
                "invalid_request_error",
                "invalid_host",
            ), None
        origin = headers.get("origin")
        if origin is not None and origin.rstrip("/").lower() not in self.origins:
            return _error(
                403,
                f"requests from web pages of origin {origin!r} are not allowed "
                "(start the server with --allowed-origin ORIGIN to allow one)",
                "invalid_request_error",
                "origin_not_allowed",
            ), None
        if path in self.OPEN_PATHS:
            return None, None
        owner = self.keys.owner(headers.get("authorization"))
        if owner is None:
            given = "authorization" in headers
            return _error(
                401,
                "Incorrect API key provided."
                if given
                else "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.",
                "invalid_request_error",
                "invalid_api_key",
            ), None
        return None, owner


def owner_of(request: Request) -> str:
    """The owner :class:`HttpGuard` found for ``request`` (:data:`ANONYMOUS` without one)."""
    return getattr(request.state, OWNER_STATE, ANONYMOUS)


class GrpcAuth(grpc.ServerInterceptor):
    """Ends every call without a valid key (metadata ``authorization: Bearer KEY``) with
    ``UNAUTHENTICATED``; ``on_refuse()`` counts them."""

    def __init__(self, keys: ApiKeys, on_refuse=lambda: None):
        self.keys = keys
        self.on_refuse = on_refuse

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.owner(metadata.get("authorization")) is not None:
            return continuation(handler_call_details)
        self.on_refuse()
        handler = continuation(handler_call_details)
        message = "missing or wrong API key: send metadata 'authorization: Bearer KEY'"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler is not None and handler.response_streaming:
            if handler.request_streaming:
                return grpc.stream_stream_rpc_method_handler(deny)
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def grpc_owner(keys: ApiKeys, context: grpc.ServicerContext) -> str:
    """The owner of a gRPC call (:class:`GrpcAuth` has already refused calls without one)."""
    metadata = dict(context.invocation_metadata() or ())
    owner = keys.owner(metadata.get("authorization"))
    if owner is None:  # only reachable without the interceptor
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
    return owner  # type: ignore[return-value]
