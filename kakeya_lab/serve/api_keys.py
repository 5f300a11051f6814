"""API keys and session owners (standard library only: the CLI reads keys cheaply).

A server's keys come from ``--api-key-file`` (one a line) and ``$KAKEYA_LAB_API_KEY``. A
request presents one as ``Authorization: Bearer KEY`` (HTTP header, gRPC metadata); its
*owner* is a hash of the key (the key itself is never kept with a session). A keyless
server has one owner, :data:`ANONYMOUS`. Clients (:class:`~kakeya_lab.serve.client.SessionClient`,
the served long run) send ``$KAKEYA_LAB_API_KEY`` when it is set.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

ANONYMOUS = "anonymous"  # the one owner of every session on a keyless server
KEY_ENV = "KAKEYA_LAB_API_KEY"


def client_key(api_key: str | None = None) -> str | None:
    """``api_key``, else ``$KAKEYA_LAB_API_KEY`` (None when neither is set)."""
    return api_key if api_key is not None else (os.environ.get(KEY_ENV, "").strip() or None)


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """The HTTP ``Authorization`` header for :func:`client_key` (empty without a key)."""
    key = client_key(api_key)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys(key_file: str | Path | None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The keys of ``key_file`` (one a line; blank lines and ``#`` comments skipped) and of
    ``$KAKEYA_LAB_API_KEY``; ValueError for an unreadable file or one without a key."""
    env = os.environ if environ is None else environ
    keys = []
    if key_file is not None:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {str(key_file)!r}: {exc}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        if not keys:
            raise ValueError(f"the API key file {str(key_file)!r} holds no key (one a line)")
    if env.get(KEY_ENV, "").strip():
        keys.append(env[KEY_ENV].strip())
    for key in keys:
        if len(key) < 8 or any(c.isspace() for c in key):
            raise ValueError("an API key must be at least 8 characters without spaces")
    return keys


class ApiKeys:
    """The keys a server accepts (none: every caller is :data:`ANONYMOUS`)."""

    def __init__(self, keys: Iterable[str] = ()):
        self._digests = [_digest(k) for k in dict.fromkeys(keys)]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def owner(self, authorization: str | None) -> str | None:
        """The owner for an ``Authorization`` value (``Bearer KEY``), or None if the key is
        missing or wrong. Every key is compared, in constant time, whatever matches."""
        if not self._digests:
            return ANONYMOUS
        scheme, _, presented = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        digest = _digest(presented.strip())
        match = None
        for known in self._digests:
            if hmac.compare_digest(digest, known):
                match = known
        return None if match is None else "key:" + match.hex()[:32]
