"""Finding a model's folder offline, without torch: a registry name (its store folder,
pulled if asked), a local folder or a cached Hugging Face Hub id, verified before anything
is read from it. :func:`kakeya_lab.models.load.load_model` loads what this finds; the
commands that check a resume against a run folder's model identity use it alone, so a
refusal comes before torch is imported."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kakeya_lab.models.errors import ModelNotAvailableError
from kakeya_lab.models.pull import pull
from kakeya_lab.models.registry import REGISTRY
from kakeya_lab.models.store import (
    MANIFEST_NAME,
    folder_present,
    model_dir,
    safetensors_files,
    weight_sha256,
)
from kakeya_lab.models.verify import verify_folder

__all__ = ["ResolvedFolder", "resolve"]


def _no_network_hint(what: str) -> str:
    return (
        f"{what}. There is no network at run time (only the package index, used by "
        f"`kakeya-lab models pull`): pull a registry model with `kakeya-lab models pull NAME` "
        f"(known: {', '.join(REGISTRY)}) or pass a local folder holding *.safetensors."
    )


def _check_safetensors_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise ModelNotAvailableError(
            f"{folder} is not a folder (expected a safetensors model folder)"
        )
    if not safetensors_files(folder):
        raise ModelNotAvailableError(
            f"{folder} holds no *.safetensors weights; only safetensors folders are loaded "
            "(no .bin/.pt pickles, no GGUF: use `kakeya-lab models pull NAME` for registry models)"
        )
    if not (folder / "config.json").is_file():
        raise ModelNotAvailableError(f"{folder} has no config.json")


def _looks_like_hub_id(s: str) -> bool:
    """``name`` or ``org/name`` made of letters, digits, ``_``, ``-`` and ``.``."""
    return not s.startswith((".", "~")) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", s) is not None


@dataclass(frozen=True)
class ResolvedFolder:
    """A model folder found offline: ``folder``, display ``name``, ``source`` (see
    :class:`~kakeya_lab.models.load.ModelDescription`) and the ``weight_sha256`` of its
    safetensors files (the manifest's, verified, for folders with a manifest; computed
    otherwise)."""

    folder: Path
    name: str
    source: str
    weight_sha256: str


def resolve(
    name_or_path: str, *, pull_if_missing: bool, progress: bool, verify: bool = False
) -> ResolvedFolder:
    """Find and verify the folder of a registry name, local folder or cached Hub id.

    A folder with a ``manifest.json`` (every registry store folder) is checked with
    :func:`~kakeya_lab.models.verify.verify_folder` (``full=verify``) before anything is
    read from it: :class:`CorruptModelError` naming the file and the repair otherwise.
    """
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
        folder = model_dir(spec.name)
        if not folder_present(folder):
            if not pull_if_missing:
                raise ModelNotAvailableError(
                    f"model {spec.name!r} is not pulled; run `kakeya-lab models pull {spec.name}`"
                )
            folder = pull(spec.name, progress=progress)
        checked = verify_folder(folder, full=verify, name=spec.name)
        _check_safetensors_folder(folder)
        return ResolvedFolder(
            folder,
            spec.name,
            f"registry:{spec.name} ({spec.source}, gguf sha256 {spec.gguf_sha256})",
            checked.manifest["weight_sha256"],
        )
    path = Path(name_or_path).expanduser()
    if path.exists():
        path = path.resolve()
        if (path / MANIFEST_NAME).exists():
            manifest = verify_folder(path, full=verify).manifest
            _check_safetensors_folder(path)
            name = str(manifest.get("name") or path.name)
            return ResolvedFolder(path, name, f"local:{path}", manifest["weight_sha256"])
        _check_safetensors_folder(path)
        return ResolvedFolder(path, path.name, f"local:{path}", weight_sha256(path))
    if not _looks_like_hub_id(name_or_path):
        raise ModelNotAvailableError(
            _no_network_hint(f"{name_or_path!r} is neither a registry name nor an existing folder")
        )
    # A Hub id: only what is already in the local Hugging Face cache; never the network.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name_or_path, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError, ValueError):
        raise ModelNotAvailableError(
            _no_network_hint(
                f"{name_or_path!r} is not a registry name, not a local folder and not in the "
                "local Hugging Face cache"
            )
        ) from None
    _check_safetensors_folder(snapshot)
    return ResolvedFolder(
        snapshot, name_or_path, f"hf-cache:{name_or_path}", weight_sha256(snapshot)
    )
