"""Drafter checkpoints: ``drafter.safetensors`` (trainable weights only) + ``drafter.json``
(its :class:`~kakeya_lab.proposers.drafters.network.DrafterConfig`, which names the verifier's weight
sha256 and vocabulary). Loading checks both against the verifier it is given, so a
drafter is never silently used with a model it was not trained for.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kakeya_lab.proposers.drafters.network import DrafterConfig, build_drafter, trainable_state

if TYPE_CHECKING:
    from kakeya_lab.proposers.drafters.network import AnyDrafter

WEIGHTS, CONFIG = "drafter.safetensors", "drafter.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupted, or made for another verifier."""


def write_folder_atomic(folder: str | Path, files: dict[str, Any]) -> Path:
    """Write a folder of files at once: build it beside ``folder``, then swap it in.

    ``files`` maps names to a dict (JSON) or to ``{name: tensor}`` (safetensors, for names
    ending in ``.safetensors``).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    for name, content in files.items():
        if name.endswith(".safetensors"):
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in content.items()}, str(tmp / name)
            )
        else:
            (tmp / name).write_text(json.dumps(content, indent=1))
    old = folder.with_name(f".{folder.name}.old")
    if folder.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old.exists():
        shutil.rmtree(old)
    return folder


def save_drafter(drafter: AnyDrafter, folder: str | Path, extra: dict | None = None) -> Path:
    """Save ``drafter`` (its config and trainable weights) into ``folder``."""
    config = {**drafter.config.to_dict(), **({"extra": extra} if extra else {})}
    return write_folder_atomic(folder, {WEIGHTS: trainable_state(drafter), CONFIG: config})


def read_json(path: Path, what: str) -> dict:
    if not path.exists():
        raise CheckpointError(f"{path.parent} is not a {what}: {path.name} is missing")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is corrupted: {exc}") from exc


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is corrupted or not safetensors: {exc}") from exc


def drafter_config(folder: str | Path) -> DrafterConfig:
    raw = read_json(Path(folder) / CONFIG, "drafter checkpoint")
    raw.pop("extra", None)
    try:
        return DrafterConfig(**raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{folder}/{CONFIG} does not describe a drafter: {exc}") from exc


def check_verifier(config: DrafterConfig, loaded, where: str) -> None:
    """Raise :class:`CheckpointError` unless ``config`` was made for ``loaded``'s model."""
    model = loaded.model
    vocab = model.get_input_embeddings().num_embeddings
    if config.vocab_size != vocab or config.hidden_size != model.config.hidden_size:
        raise CheckpointError(
            f"{where} is for a verifier with vocabulary {config.vocab_size} and width "
            f"{config.hidden_size}; {loaded.description.name} has {vocab} and {model.config.hidden_size}"
        )
    sha = loaded.description.weight_sha256
    if config.verifier_sha256 and sha and config.verifier_sha256 != sha:
        raise CheckpointError(
            f"{where} was trained against verifier weights {config.verifier_sha256[:12]}…, "
            f"but {loaded.description.name} has {sha[:12]}…: drafters are tied to their verifier"
        )


def load_drafter(folder: str | Path, loaded) -> AnyDrafter:
    """Load a drafter saved by :func:`save_drafter` for the verifier ``loaded``."""
    folder = Path(folder)
    config = drafter_config(folder)
    check_verifier(config, loaded, str(folder))
    drafter = build_drafter(config, loaded.model)
    load_trainable(drafter, read_tensors(folder / WEIGHTS), str(folder / WEIGHTS))
    drafter.eval()
    return drafter


def load_trainable(drafter: AnyDrafter, state: dict[str, torch.Tensor], where: str) -> None:
    """Load exactly the trainable weights of ``drafter`` from ``state``."""
    expected = set(trainable_state(drafter))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{where} does not fit its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    try:
        drafter.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise CheckpointError(f"{where} does not fit its config: {exc}") from exc
