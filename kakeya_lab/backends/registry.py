"""The backend registry: every model runtime the verifier can sit on, by name.

A backend is one module plus one :func:`register` call. The registry imports no tensor
runtime: a backend's module is imported the first time a model of that backend is used,
and ``detect`` must tell a model of its runtime without importing that runtime (a model
object cannot exist before its runtime was imported, so ``sys.modules`` suffices).

A backend module provides (see :class:`BackendModule`):

* ``make_backend(model, config, *, block_padding=None, lean=None)`` — the
  :class:`~kakeya_lab.backends.seam.Backend` for one sequence;
* ``vocab_size_of(model)``, ``kv_bytes_per_token(model)`` — read from a loaded model;
* ``check_tree_support(model)`` — NotImplementedError if draft trees cannot run on it;
* ``load_folder(folder, dtype)`` — a model from a transformers-written folder (safetensors
  + ``config.json``), no network (``kakeya_lab.load_model`` adds the store's checks).

Built in: ``"torch"`` (:mod:`kakeya_lab.backends.torch_backend`) and ``"mlx"``
(:mod:`kakeya_lab.backends.mlx_backend`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from kakeya_lab.backends.config import SinkWindowConfig
    from kakeya_lab.backends.seam import Backend


class BackendModule(Protocol):
    """What a registered backend's module provides."""

    def make_backend(
        self,
        model: Any,
        config: SinkWindowConfig,
        *,
        block_padding: Mapping[int, int] | None = None,
        lean: bool | None = None,
    ) -> Backend: ...

    def vocab_size_of(self, model: Any) -> int: ...

    def kv_bytes_per_token(self, model: Any) -> int: ...

    def check_tree_support(self, model: Any) -> None: ...

    def load_folder(self, folder: Path, dtype: str = "float32") -> Any: ...


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: its ``name``, the ``module`` implementing it (imported
    lazily), ``detect(model)`` (True for a model of this runtime; must not import it), and
    whether its forwards can return final hidden states (``hidden_states``: what
    hidden-state drafters read)."""

    name: str
    module: str
    detect: Callable[[Any], bool]
    hidden_states: bool = False

    def load(self) -> BackendModule:
        """The backend's module (imported on first use)."""
        return cast(BackendModule, importlib.import_module(self.module))


_ENTRIES: dict[str, BackendEntry] = {}


def register(
    name: str, module: str, detect: Callable[[Any], bool], *, hidden_states: bool = False
) -> BackendEntry:
    """Register (or replace) backend ``name``; returns its entry."""
    entry = BackendEntry(name, module, detect, hidden_states)
    _ENTRIES[name] = entry
    return entry


def names() -> tuple[str, ...]:
    """The registered backend names, in registration order."""
    return tuple(_ENTRIES)


def entry(name: str) -> BackendEntry:
    """The entry of backend ``name``; ValueError naming the registered ones otherwise."""
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(names())}") from None


def entry_of(model: Any) -> BackendEntry:
    """The entry of the backend ``model`` runs on; ValueError if none recognises it."""
    for candidate in _ENTRIES.values():
        if candidate.detect(model):
            return candidate
    raise ValueError(
        f"cannot tell the backend of a {type(model).__name__} (from {type(model).__module__}): "
        "pass a transformers PreTrainedModel (kakeya_lab.load_model) or an mlx-lm model "
        "(kakeya_lab.load_model(..., backend='mlx')); registered backends: "
        f"{', '.join(names())}"
    )


def name_of(model: Any) -> str:
    """The name of the backend ``model`` runs on (``"torch"``, ``"mlx"``, ...)."""
    return entry_of(model).name


def module_of(model: Any) -> BackendModule:
    """The module of the backend ``model`` runs on."""
    return entry_of(model).load()


def make_backend(
    model: Any,
    config: SinkWindowConfig,
    *,
    block_padding: Mapping[int, int] | None = None,
    lean: bool | None = None,
) -> Backend:
    """The backend for ``model`` (``block_padding`` and ``lean``: see
    :class:`~kakeya_lab.verifier.Verifier`)."""
    return module_of(model).make_backend(model, config, block_padding=block_padding, lean=lean)


def vocab_size_of(model: Any) -> int:
    """How many token ids ``model`` accepts (``0..vocab_size-1``), on any backend."""
    return module_of(model).vocab_size_of(model)


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys plus values one cached token takes over all layers of ``model``."""
    return module_of(model).kv_bytes_per_token(model)


def check_tree_support(model: Any) -> None:
    """NotImplementedError (saying what to do) if draft trees cannot be verified on
    ``model``'s backend."""
    module_of(model).check_tree_support(model)


def _runtime_instance(runtime: str, attribute: str) -> Callable[[Any], bool]:
    """``detect`` for models that are instances of ``sys.modules[runtime].<attribute>``."""

    def detect(model: Any) -> bool:
        loaded: ModuleType | None = sys.modules.get(runtime)
        return loaded is not None and isinstance(model, getattr(loaded, attribute))

    return detect


register(
    "torch",
    "kakeya_lab.backends.torch_backend",
    _runtime_instance("torch.nn", "Module"),
    hidden_states=True,
)
register("mlx", "kakeya_lab.backends.mlx_backend", _runtime_instance("mlx.nn", "Module"))
