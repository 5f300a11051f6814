"""Verifying a model folder against its ``manifest.json`` before anything is loaded from it.

The manifest lists every file the model needs (weights, config, generation config, tokenizer
files, chat template) with its size and sha256. Hashing 0.5-3.5 GB on every load would cost
seconds, so a *stamp* per file is kept beside the manifest in ``stamps.json``: the file's
size, ``st_mtime_ns``, ``st_ctime_ns`` and inode when its bytes were last hashed and found
equal to the manifest. :func:`verify_folder`

* refuses at once (no hashing) if a listed file is missing or has another size;
* trusts the recorded sha256 of a file whose stamp still matches;
* re-hashes every other file fully (changed stamp, no stamp, or ``full=True``) and refuses
  if a hash differs; matching files get a fresh stamp.

Files not listed in the manifest (notes, editor backups) are ignored: the loader only reads
listed files. Refusals raise :class:`CorruptModelError` naming each file and the repair.

Residual risk of stamps: an edit that keeps the size, the mtime *and* the ctime passes the
default check. Restoring the mtime with ``os.utime`` is not enough (it sets the ctime to
now), so this takes changing the system clock or writing the block device underneath the
file system. ``full=True`` (``load_model(verify=True)``, ``kakeya-lab models verify``)
re-hashes every file regardless of stamps.

Manifests written before the store listed every file (``"files_complete"`` absent) list only
the weights. They are upgraded in place on first verification: the weights are hashed fully
and must match the recorded sha256; config.json, tokenizer.json and tokenizer_config.json
must exist; the other files present are then recorded as they are (trust on first use,
named under ``"files_recorded_on_upgrade"``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kakeya_lab.models.errors import CorruptModelError, ModelNotAvailableError
from kakeya_lab.models.registry import REGISTRY, get_spec
from kakeya_lab.models.store import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    STAMPS_NAME,
    content_files,
    folder_present,
    model_dir,
    sha256_files,
    write_json_atomic,
)

__all__ = [
    "REQUIRED_FILES",
    "Verification",
    "repair_hint",
    "verify_folder",
    "verify_model",
    "write_stamps",
]

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_STAMP_KEYS = ("size", "mtime_ns", "ctime_ns", "inode")


@dataclass(frozen=True)
class Verification:
    """Outcome of a successful :func:`verify_folder`.

    ``manifest`` is the (possibly upgraded) manifest; ``files_checked`` the number of files
    it lists; ``files_hashed``/``bytes_hashed`` what was actually re-read (0 when every
    stamp matched); ``upgraded`` is True if an older weights-only manifest was completed.
    """

    folder: Path
    manifest: dict[str, Any]
    files_checked: int
    files_hashed: int
    bytes_hashed: int
    upgraded: bool


def repair_hint(folder: Path, name: str | None) -> str:
    """How to repair ``folder``: re-pull a registry store folder, restore a local one."""
    if name in REGISTRY and Path(folder) == model_dir(name):
        return (
            f"Repair: `kakeya-lab models pull {name} --force` (downloads and converts it again); "
            f"check every file: `kakeya-lab models verify {name}`."
        )
    return (
        f"Repair: restore the files or copy the model folder again; check every file: "
        f"`kakeya-lab models verify {folder}`."
    )


def _corrupt(folder: Path, name: str | None, problems: dict[str, str]) -> CorruptModelError:
    what = f"model {name!r} at {folder}" if name else f"model folder {folder}"
    listing = "; ".join(f"{fname}: {why}" for fname, why in problems.items())
    return CorruptModelError(f"{what} is corrupt: {listing}. {repair_hint(folder, name)}", problems)


def _stamp(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def _read_stamps(folder: Path) -> dict[str, Any]:
    try:
        stamps = json.loads((folder / STAMPS_NAME).read_text(encoding="utf-8"))
        files = stamps.get("files") if isinstance(stamps, dict) else None
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError):
        return {}


def write_stamps(folder: Path, verified: dict[str, tuple[os.stat_result, str]]) -> None:
    """Record the stamps of files whose bytes were just found equal to ``sha256``
    (``{file name: (stat, sha256)}``), keeping the other stamps. Best effort: a read-only
    folder keeps no stamps and is re-hashed on every load."""
    stamps = _read_stamps(folder)
    for fname, (st, sha) in verified.items():
        stamps[fname] = {**_stamp(st), "sha256": sha}
    try:
        write_json_atomic(folder / STAMPS_NAME, {"schema": 1, "files": stamps})
    except OSError:
        pass


def _stamp_matches(stamp: Any, st: os.stat_result, sha256: str) -> bool:
    if not isinstance(stamp, dict) or stamp.get("sha256") != sha256:
        return False
    return all(stamp.get(k) == v for k, v in _stamp(st).items())


def _load_manifest(folder: Path, name: str | None) -> dict[str, Any]:
    path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _corrupt(folder, name, {MANIFEST_NAME: "missing"}) from None
    except (OSError, ValueError) as exc:
        raise _corrupt(folder, name, {MANIFEST_NAME: f"unreadable ({exc})"}) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("schema") != MANIFEST_SCHEMA or not isinstance(files, dict) or not files:
        raise _corrupt(
            folder, name, {MANIFEST_NAME: f"not a schema-{MANIFEST_SCHEMA} manifest with files"}
        )
    for fname, info in files.items():
        ok = isinstance(info, dict) and isinstance(info.get("size"), int)
        if not ok or not isinstance(info.get("sha256"), str) or "/" in fname:
            raise _corrupt(folder, name, {MANIFEST_NAME: f"bad entry for {fname!r}"})
    return manifest


def _upgrade(
    folder: Path, manifest: dict[str, Any], name: str | None
) -> tuple[dict[str, Any], dict[str, tuple[os.stat_result, str]], int]:
    """Complete a weights-only manifest; returns (manifest, verified stamps, bytes hashed)."""
    listed = manifest["files"]
    problems = {f: "missing" for f in (*listed, *REQUIRED_FILES) if not (folder / f).is_file()}
    if problems:
        raise _corrupt(folder, name, problems)
    present = content_files(folder)
    stats = {p.name: p.stat() for p in present}
    _, got = sha256_files(present)
    for fname, info in listed.items():
        if got[fname] != info["sha256"]:
            problems[fname] = (
                f"sha256 {got[fname][:12]}…, manifest.json says {info['sha256'][:12]}…"
            )
        elif stats[fname].st_size != info["size"]:
            problems[fname] = f"{stats[fname].st_size} bytes, manifest.json says {info['size']}"
    if problems:
        raise _corrupt(folder, name, problems)
    added = sorted(set(got) - set(listed))
    files = {f: {"sha256": got[f], "size": stats[f].st_size} for f in sorted(got)}
    manifest = {
        **manifest,
        "files": files,
        "files_complete": True,
        "files_recorded_on_upgrade": added,
    }
    write_json_atomic(folder / MANIFEST_NAME, manifest)
    verified = {f: (stats[f], got[f]) for f in got}
    return manifest, verified, sum(st.st_size for st in stats.values())


def verify_folder(folder: Path, *, full: bool = False, name: str | None = None) -> Verification:
    """Check that ``folder`` holds exactly the bytes its ``manifest.json`` lists.

    ``full=False`` re-hashes only files whose stamp changed (see the module docstring);
    ``full=True`` re-hashes every file. ``name`` is the model's registry name if it is one
    (for the repair hint). Raises :class:`CorruptModelError` if the manifest is missing or
    unreadable, a listed file is missing, has another size or other bytes, or a registry
    model's manifest records another GGUF sha256 than the registry; the message names every
    offending file and how to repair. Extra files are ignored. Writes fresh stamps (and
    upgrades a weights-only manifest, see the module docstring).
    """
    folder = Path(folder)
    manifest = _load_manifest(folder, name)
    name = name or manifest.get("name")
    spec = REGISTRY.get(str(name))
    if spec is not None and folder == model_dir(spec.name):
        if manifest.get("gguf_sha256") != spec.gguf_sha256:
            raise _corrupt(
                folder,
                name,
                {
                    MANIFEST_NAME: f"gguf_sha256 {str(manifest.get('gguf_sha256'))[:12]}…, the "
                    f"registry says {spec.gguf_sha256[:12]}… (made from other bytes)"
                },
            )
    if not manifest.get("files_complete"):
        manifest, upgraded, hashed = _upgrade(folder, manifest, name)
        write_stamps(folder, upgraded)
        n_files = len(manifest["files"])
        return Verification(folder, manifest, n_files, n_files, hashed, upgraded=True)

    files: dict[str, dict[str, Any]] = manifest["files"]
    problems: dict[str, str] = {}
    stats: dict[str, os.stat_result] = {}
    for fname, info in files.items():
        try:
            stats[fname] = st = (folder / fname).stat()
        except FileNotFoundError:
            problems[fname] = "missing"
            continue
        if st.st_size != info["size"]:
            problems[fname] = (
                f"{st.st_size} bytes, manifest.json says {info['size']} (truncated or replaced)"
            )
    if problems:  # refuse before reading any bytes
        raise _corrupt(folder, name, problems)

    stamps = _read_stamps(folder)
    stale = [
        f for f, info in files.items()
        if full or not _stamp_matches(stamps.get(f), stats[f], info["sha256"])
    ]  # fmt: skip
    _, got = sha256_files([folder / f for f in stale])
    verified: dict[str, tuple[os.stat_result, str]] = {}
    for fname in stale:
        expected = files[fname]["sha256"]
        if got[fname] == expected:
            verified[fname] = (stats[fname], expected)
        else:
            problems[fname] = (
                f"sha256 {got[fname][:12]}…, manifest.json says {expected[:12]}… (bytes changed)"
            )
    if verified:
        write_stamps(folder, verified)
    if problems:
        raise _corrupt(folder, name, problems)
    return Verification(
        folder,
        manifest,
        files_checked=len(files),
        files_hashed=len(stale),
        bytes_hashed=sum(stats[f].st_size for f in stale),
        upgraded=False,
    )


def verify_model(name_or_path: str, *, full: bool = True) -> Verification:
    """Verify a registry model's store folder (or a local folder holding a manifest):
    :func:`verify_folder` with ``full=True`` by default (every file re-hashed).

    Raises :class:`UnknownModelError` for a name that is neither a registry name nor a
    folder, :class:`ModelNotAvailableError` if the model is not pulled or the folder has no
    manifest, :class:`CorruptModelError` if a file does not match.
    """
    if name_or_path in REGISTRY:
        folder = model_dir(name_or_path)
        if not folder_present(folder):
            raise ModelNotAvailableError(
                f"model {name_or_path!r} is not pulled; run `kakeya-lab models pull {name_or_path}`"
            )
        return verify_folder(folder, full=full, name=name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        get_spec(name_or_path)  # UnknownModelError listing the registry names
    if not (path / MANIFEST_NAME).exists():
        raise ModelNotAvailableError(f"{path} has no {MANIFEST_NAME}: nothing to verify against")
    return verify_folder(path.resolve(), full=full)
