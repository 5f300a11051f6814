"""kakeya_lab: a research workbench for bounded-memory LLM sessions and speculative decoding."""

from kakeya_lab.cache import SinkWindowCache, SinkWindowConfig
from kakeya_lab.verifier import Verifier

__version__ = "0.1.0"

__all__ = ["SinkWindowCache", "SinkWindowConfig", "Verifier", "__version__"]
