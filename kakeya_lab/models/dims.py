"""The attention shape of a model: what a KV cache must hold per layer.

One place reads these numbers from a transformers config, for model descriptions and for
the KV cache (``kv bytes = tokens × num_layers × num_kv_heads × head_dim × 2 × dtype bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelDims", "config_dims", "model_dims"]


@dataclass(frozen=True)
class ModelDims:
    """Shape of a decoder-only transformer.

    ``num_layers`` decoder layers, each with ``num_attention_heads`` query heads sharing
    ``num_kv_heads`` key/value heads of ``head_dim`` channels; residual width
    ``hidden_size`` channels; ``vocab_size`` token ids.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    vocab_size: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of keys plus values one cached token takes over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * int(dtype_bytes)


def config_dims(config: Any) -> ModelDims:
    """:class:`ModelDims` of a transformers ``PretrainedConfig`` (its text config if it has
    one). ``num_kv_heads`` defaults to ``num_attention_heads`` (no GQA) and ``head_dim`` to
    ``hidden_size // num_attention_heads`` when the config does not say."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    return ModelDims(
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        num_attention_heads=heads,
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
    )


def model_dims(model: Any) -> ModelDims:
    """:class:`ModelDims` of a transformers model (read from ``model.config``)."""
    return config_dims(model.config)
