"""kakeya_lab: a research workbench for bounded-memory LLM sessions and speculative decoding.

Public names (stable): ``load_model``, ``SinkWindowConfig``, ``SinkWindowCache``,
``Verifier``, ``SessionStore`` and the ``reference`` oracles.
"""

from kakeya_lab.blas import prefer_system_blas

prefer_system_blas()  # before anything imports mlx: see kakeya_lab/blas.py

from kakeya_lab import reference  # noqa: E402
from kakeya_lab.backends.config import SinkWindowConfig  # noqa: E402
from kakeya_lab.backends.torch_cache import SinkWindowCache  # noqa: E402
from kakeya_lab.models import DEFAULT_MODEL, load_model, tiny_random_model  # noqa: E402
from kakeya_lab.session import SessionStore  # noqa: E402
from kakeya_lab.tree import DraftTree  # noqa: E402
from kakeya_lab.verifier import Verifier  # noqa: E402

__version__ = "0.1.0"

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
