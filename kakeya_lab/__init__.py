"""kakeya_lab: a research workbench for bounded-memory LLM sessions and speculative decoding.

Public names (stable): ``load_model``, ``SinkWindowConfig``, ``SinkWindowCache``,
``Verifier``, ``SessionStore`` and the ``reference`` oracles.
"""

from kakeya_lab import reference
from kakeya_lab.cache import SinkWindowCache, SinkWindowConfig
from kakeya_lab.models import DEFAULT_MODEL, load_model, tiny_random_model
from kakeya_lab.session import SessionStore
from kakeya_lab.verifier import Verifier

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "SessionStore",
    "SinkWindowCache",
    "SinkWindowConfig",
    "Verifier",
    "__version__",
    "load_model",
    "reference",
    "tiny_random_model",
]
