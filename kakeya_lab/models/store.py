"""The model store on disk: layout, manifest, hashing.

The store lives under ``$KAKEYA_LAB_HOME`` (default ``~/.cache/kakeya_lab``)::

    <store>/models/<name>/        model.safetensors, config.json, tokenizer.json, ...
    <store>/models/<name>/manifest.json   every file above with its size and sha256
    <store>/models/<name>/stamps.json     size/mtime/ctime/inode of each file when last hashed
    <store>/tmp/                  work folders of pulls in progress (removed afterwards)
    <store>/locks/<name>.lock     one pull per model at a time (POSIX advisory lock)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kakeya_lab.durable import write_json_atomic  # the package's one atomic writer
from kakeya_lab.models.errors import ModelNotAvailableError
from kakeya_lab.models.registry import REGISTRY, get_spec

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "STAMPS_NAME",
    "content_files",
    "dir_size",
    "folder_present",
    "list_models",
    "model_dir",
    "pull_lock",
    "read_manifest",
    "safetensors_files",
    "sha256_file",
    "sha256_files",
    "store_home",
    "weight_sha256",
    "write_json_atomic",
]

MANIFEST_NAME = "manifest.json"
# Schema 1 throughout: manifests written since the store lists every file carry
# "files_complete": true (older ones list only the weights; see kakeya_lab.models.verify).
MANIFEST_SCHEMA = 1
STAMPS_NAME = "stamps.json"
CHUNK_BYTES = 8 << 20  # 8 MiB: streaming copy/hash block


def store_home() -> Path:
    """Root of the model store: ``$KAKEYA_LAB_HOME`` if set and non-empty, else
    ``~/.cache/kakeya_lab``. Read on every call (not cached), so tests may change it."""
    env = os.environ.get("KAKEYA_LAB_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kakeya_lab"


def model_dir(name: str) -> Path:
    """Store folder of the registry model ``name`` (whether or not it has been pulled)."""
    return store_home() / "models" / get_spec(name).name


def folder_present(folder: Path) -> bool:
    """A store folder counts as present (pulled, or a corrupt remnant) once it exists with
    anything in it; absent or empty means not pulled."""
    return folder.is_dir() and any(folder.iterdir())


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` of a store folder if it is present *and valid*, else None.

    Valid means: it parses, has the current schema, and every file it lists exists with the
    recorded size (a cheap check, no hashing: :func:`kakeya_lab.models.verify.verify_folder`
    checks the bytes). For a registry model the recorded GGUF sha256 must also match the
    registry.
    """
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for fname, info in files.items():
        try:
            if (folder / fname).stat().st_size != info["size"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    spec = REGISTRY.get(manifest.get("name", ""))
    if spec is not None and manifest.get("gguf_sha256") != spec.gguf_sha256:
        return None
    if not (folder / "config.json").is_file():
        return None
    return manifest


def content_files(folder: Path) -> list[Path]:
    """The files a model folder consists of: every regular file directly in ``folder`` except
    ``manifest.json``, ``stamps.json`` and leftover ``*.tmp`` files, sorted by name."""
    return sorted(
        (
            p
            for p in folder.iterdir()
            if p.is_file() and p.name not in (MANIFEST_NAME, STAMPS_NAME) and p.suffix != ".tmp"
        ),
        key=lambda p: p.name,
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``folder``, sorted by name."""
    return sorted(folder.glob("*.safetensors"), key=lambda p: p.name)


def sha256_files(paths: list[Path]) -> tuple[str, dict[str, str]]:
    """Stream the files once: ``(sha256 of their bytes concatenated in the given order,
    {file name: sha256 of that file})``. The one streaming hash of the package."""
    overall = hashlib.sha256()
    per_file: dict[str, str] = {}
    for path in paths:
        one = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(CHUNK_BYTES):
                one.update(block)
                overall.update(block)
        per_file[Path(path).name] = one.hexdigest()
    return overall.hexdigest(), per_file


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of one file's bytes, streamed in 8 MiB blocks."""
    return sha256_files([Path(path)])[1][Path(path).name]


def weight_sha256(folder: str | os.PathLike[str]) -> str:
    """sha256 over the bytes of every ``*.safetensors`` file in ``folder``, concatenated in
    sorted file-name order (a single-file model: the sha256 of that file). Reads the files."""
    files = safetensors_files(Path(folder))
    if not files:
        raise ModelNotAvailableError(f"no *.safetensors files in {folder}")
    return sha256_files(files)[0]


def dir_size(folder: Path) -> int:
    """Bytes on disk of every file under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@contextlib.contextmanager
def pull_lock(name: str) -> Iterator[None]:
    """Exclusive advisory lock per model name, so concurrent pulls do the work once."""
    lock_dir = store_home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock; the atomic rename still holds
        yield
        return
    with open(lock_dir / f"{name}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def list_models() -> list[dict[str, Any]]:
    """One row per registry entry, in registry order, with keys:

    ``name``, ``default`` (bool), ``pulled`` (bool: the store folder has a valid manifest),
    ``path`` (store folder, str, whether or not pulled), ``size`` (bytes on disk of the store
    folder, None unless pulled), ``dtype`` (storage dtype), ``licence``, ``source`` (the
    packages), ``sha256`` (expected sha256 of the assembled GGUF, the checksum :func:`pull`
    verifies), ``weight_sha256`` (of the safetensors files, from the manifest; None unless
    pulled). No network.
    """
    rows = []
    for spec in REGISTRY.values():
        folder = model_dir(spec.name)
        manifest = read_manifest(folder)
        rows.append(
            {
                "name": spec.name,
                "default": spec.default,
                "pulled": manifest is not None,
                "path": str(folder),
                "size": dir_size(folder) if manifest is not None else None,
                "dtype": spec.store_dtype,
                "licence": spec.licence,
                "source": spec.source,
                "sha256": spec.gguf_sha256,
                "weight_sha256": manifest["weight_sha256"] if manifest else None,
            }
        )
    return rows
