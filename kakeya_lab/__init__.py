"""kakeya_lab: a research workbench for bounded-memory LLM sessions and speculative decoding.

Public names (stable): ``load_model``, ``SinkWindowConfig``, ``SinkWindowCache``,
``Verifier``, ``SessionStore`` and the ``reference`` oracles.

Importing the package is cheap: each public name is imported on first use (PEP 562), so
``kakeya-lab --help`` and the torch-free modules never pay for torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kakeya_lab.blas import prefer_system_blas_before_mlx

prefer_system_blas_before_mlx()  # whoever imports mlx later: see kakeya_lab/blas.py

if TYPE_CHECKING:
    from kakeya_lab import reference
    from kakeya_lab.backends.config import SinkWindowConfig
    from kakeya_lab.backends.torch_cache import SinkWindowCache
    from kakeya_lab.models import DEFAULT_MODEL, load_model, tiny_random_model
    from kakeya_lab.session import SessionStore
    from kakeya_lab.tree import DraftTree
    from kakeya_lab.verifier import Verifier

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "DEFAULT_MODEL": "kakeya_lab.models",
    "DraftTree": "kakeya_lab.tree",
    "SessionStore": "kakeya_lab.session",
    "SinkWindowCache": "kakeya_lab.backends.torch_cache",
    "SinkWindowConfig": "kakeya_lab.backends.config",
    "Verifier": "kakeya_lab.verifier",
    "load_model": "kakeya_lab.models",
    "tiny_random_model": "kakeya_lab.models",
}

__all__ = [
    "DEFAULT_MODEL",
    "DraftTree",
    "SessionStore",
    "SinkWindowCache",
    "SinkWindowConfig",
    "Verifier",
    "__version__",
    "load_model",
    "reference",
    "tiny_random_model",
]


def __getattr__(name: str) -> Any:
    if name == "reference":
        return importlib.import_module("kakeya_lab.reference")
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'kakeya_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
