"""Named drafters: a trained drafter as an artefact of the model store, loaded by name.

Layout (``$KAKEYA_LAB_DRAFTERS``, default ``<store>/drafters``; see
:func:`kakeya_lab.models.store_home`)::

    <drafters>/<name>/drafter.safetensors   trainable weights (as :func:`save_drafter`)
    <drafters>/<name>/drafter.json          its DrafterConfig (kind, shape, verifier sha256)
    <drafters>/<name>/record.json           verifier name + weight_sha256, kind, shape, training
    <drafters>/<name>/manifest.json         every file above with its size and sha256

A drafter is written into a hidden ``.<name>.*`` folder beside its final place and renamed
into place only once every file and the manifest are written, so an interrupted save leaves
no folder under the name. Only folders with a valid manifest (every file present with its
recorded size) are listed or loaded; loading re-hashes the files (they are small) and
refuses a drafter made for other verifier weights, naming both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import save_file

from kakeya_lab.linear import linear_kernel_of, set_linear_kernel
from kakeya_lab.models.store import sha256_files, store_home
from kakeya_lab.proposers.drafters.checkpoint import (
    CONFIG,
    WEIGHTS,
    CheckpointError,
    drafter_config,
    load_trainable,
    read_tensors,
)
from kakeya_lab.proposers.drafters.network import build_drafter, trainable_state

if TYPE_CHECKING:
    from kakeya_lab.proposers.drafters.network import AnyDrafter

RECORD, MANIFEST = "record.json", "manifest.json"
SCHEMA = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


class DrafterNotFound(CheckpointError):
    """No complete named drafter of that name (the message lists those that exist)."""


class DrafterVerifierMismatch(CheckpointError):
    """A named drafter used with verifier weights other than those it was trained for."""


def drafters_home() -> Path:
    """Folder of named drafters: ``$KAKEYA_LAB_DRAFTERS`` if set and non-empty, else
    ``<store>/drafters``. Read on every call."""
    env = os.environ.get("KAKEYA_LAB_DRAFTERS")
    return Path(env).expanduser() if env else store_home() / "drafters"


def check_name(name: str) -> str:
    """``name`` if it is a valid drafter name (lower-case letters, digits, ``.``, ``_``,
    ``-``; at most 64 characters; not starting with a dot), else ``ValueError``."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"bad drafter name {name!r}: use lower-case letters, digits, '.', '_' and '-' "
            "(at most 64 characters, starting with a letter or digit), e.g. smollm2-feature"
        )
    return name


def _manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest if it parses and every file it lists has its recorded size."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("schema") != SCHEMA or not isinstance(files, dict):
        return None
    for fname in (WEIGHTS, CONFIG, RECORD):
        info = files.get(fname)
        try:
            if info is None or (folder / fname).stat().st_size != info["size"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    return manifest


def list_drafters() -> list[dict[str, Any]]:
    """One row per complete named drafter, sorted by name: ``name``, ``path``, ``kind``,
    ``verifier`` (name), ``verifier_sha256``, ``steps``, ``train_loss``,
    ``held_out_loss``, ``held_out_tau``. Hidden (``.``) and incomplete folders are skipped."""
    home = drafters_home()
    rows = []
    for folder in sorted(home.iterdir()) if home.is_dir() else []:
        if folder.name.startswith(".") or not folder.is_dir() or _manifest(folder) is None:
            continue
        try:
            record = json.loads((folder / RECORD).read_text())
        except (OSError, ValueError):
            continue
        training = record.get("training", {})
        rows.append(
            {
                "name": folder.name,
                "path": str(folder),
                "kind": record.get("kind"),
                "verifier": record.get("verifier", {}).get("name"),
                "verifier_sha256": record.get("verifier", {}).get("weight_sha256"),
                "steps": training.get("steps"),
                "train_loss": training.get("train_loss"),
                "held_out_loss": training.get("held_out_loss"),
                "held_out_tau": training.get("held_out_tau"),
            }
        )
    return rows


def drafter_names() -> list[str]:
    """Names of the complete named drafters."""
    return [r["name"] for r in list_drafters()]


def save_named_drafter(
    name: str,
    drafter: AnyDrafter,
    *,
    verifier_name: str,
    training: dict[str, Any],
    overwrite: bool = False,
) -> Path:
    """Save ``drafter`` as the named drafter ``name``; return its folder.

    ``training`` is the training record (data, steps, losses, held-out acceptance) stored
    in ``record.json`` beside the verifier's name and weight sha256 (from the drafter's
    config), its kind and shape. An existing drafter of that name is replaced only with
    ``overwrite`` (else ``FileExistsError``); the swap is a rename, never a partial folder.
    """
    check_name(name)
    home = drafters_home()
    final = home / name
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"a drafter named {name!r} exists at {final}: choose another name or overwrite it"
        )
    config = drafter.config.to_dict()
    shape = {k: v for k, v in config.items() if k not in ("draft_vocab", "verifier_sha256")}
    record = {
        "schema": SCHEMA,
        "name": name,
        "kind": config["kind"],
        "shape": {**shape, "draft_vocab_size": len(config["draft_vocab"])},
        "verifier": {"name": verifier_name, "weight_sha256": config["verifier_sha256"]},
        "training": training,
    }
    home.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=home))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; a store folder is readable like models'
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in trainable_state(drafter).items()},
            str(tmp / WEIGHTS),
        )
        (tmp / CONFIG).write_text(json.dumps(config, indent=1))
        (tmp / RECORD).write_text(json.dumps(record, indent=1))
        paths = [tmp / f for f in (WEIGHTS, CONFIG, RECORD)]
        _, per_file = sha256_files(paths)
        files = {p.name: {"size": p.stat().st_size, "sha256": per_file[p.name]} for p in paths}
        (tmp / MANIFEST).write_text(json.dumps({"schema": SCHEMA, "files": files}, indent=1))
        old = home / f".{name}.old"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _not_found(name: str, why: str) -> DrafterNotFound:
    names = drafter_names()
    known = ", ".join(names) if names else "none yet"
    return DrafterNotFound(
        f"no named drafter {name!r} ({why}) in {drafters_home()}; named drafters: {known}. "
        "Make one with `kakeya-lab align train NAME`"
    )


def read_record(name: str) -> dict[str, Any]:
    """The ``record.json`` of the complete named drafter ``name`` (files re-hashed against
    the manifest), else :class:`DrafterNotFound` / :class:`CheckpointError`."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _not_found(str(name), "not a valid drafter name")
    folder = drafters_home() / name
    if not folder.is_dir():
        raise _not_found(name, "no such folder")
    manifest = _manifest(folder)
    if manifest is None:
        raise _not_found(name, "its folder is incomplete: an interrupted save or damaged files")
    files = manifest["files"]
    _, actual = sha256_files([folder / f for f in sorted(files)])
    bad = [f for f in sorted(files) if actual[f] != files[f].get("sha256")]
    if bad:
        raise CheckpointError(
            f"named drafter {name!r} is corrupted: {', '.join(bad)} differ from its manifest; "
            "train it again (`kakeya-lab align train NAME --overwrite`)"
        )
    return json.loads((folder / RECORD).read_text())


def load_named_drafter(name: str, model, verifier_sha256: str | None) -> AnyDrafter:
    """Load the named drafter ``name`` for the verifier ``model`` whose safetensors weights
    hash to ``verifier_sha256`` (``LoadedModel.description.weight_sha256``).

    Raises :class:`DrafterNotFound` (listing the names that exist) for an unknown or
    incomplete name, :class:`DrafterVerifierMismatch` when the drafter was trained for
    other verifier weights or ``verifier_sha256`` is not given (naming both), and
    :class:`~kakeya_lab.proposers.drafters.checkpoint.CheckpointError` for damaged files or a verifier
    of another vocabulary or width. The drafter's linear layers run the verifier's kernel
    (:mod:`kakeya_lab.linear`).
    """
    record = read_record(name)
    folder = drafters_home() / name
    config = drafter_config(folder)
    trained_for = record["verifier"]
    if not verifier_sha256 or verifier_sha256 != config.verifier_sha256:
        given = verifier_sha256[:12] + "…" if verifier_sha256 else "unknown"
        raise DrafterVerifierMismatch(
            f"named drafter {name!r} was trained for verifier {trained_for['name']!r} with "
            f"weights sha256 {str(config.verifier_sha256)[:12]}…, but the verifier given has "
            f"weights sha256 {given}: load {trained_for['name']!r} or train a drafter for "
            "this verifier (`kakeya-lab align train NAME --verifier MODEL`)"
        )
    vocab = model.get_input_embeddings().num_embeddings
    if config.vocab_size != vocab or config.hidden_size != model.config.hidden_size:
        raise DrafterVerifierMismatch(
            f"named drafter {name!r} is for a verifier with vocabulary {config.vocab_size} and "
            f"width {config.hidden_size}; the verifier given has {vocab} and "
            f"{model.config.hidden_size}"
        )
    drafter = build_drafter(config, model)
    load_trainable(drafter, read_tensors(folder / WEIGHTS), str(folder / WEIGHTS))
    drafter.eval()
    # the verifier's kernel ("auto": the verifier's measured choice per row count)
    set_linear_kernel(
        drafter, linear_kernel_of(model), choice=getattr(model, "linear_auto_choice", None)
    )
    return drafter
