"""What a sink-window cache holds: :class:`SinkWindowConfig`, and its analytic KV budget.

Imports no tensor runtime, so serving code, the MLX backend and command-line checks can
read and validate a config without loading the torch cache (docs/design.md, "The
sink-window cache").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

PositionMode = Literal["global", "rolling"]


@dataclass(frozen=True)
class SinkWindowConfig:
    """Cache semantics: ``sink`` first tokens + ``window`` most recent ones.

    ``window=None`` means a full cache that never evicts (the baseline arm).
    ``positions`` is ``"global"`` (keys keep their absolute RoPE position) or
    ``"rolling"`` (StreamingLLM: sinks sit just before the window).
    """

    sink: int = 4
    window: int | None = 1020
    positions: PositionMode = "global"

    def __post_init__(self) -> None:
        from kakeya_lab import inputs

        object.__setattr__(self, "sink", inputs.size(self.sink, "sink", minimum=0))
        if self.window is not None:
            hint = "it includes the current token; None never evicts"
            window = inputs.size(self.window, "window", minimum=1, hint=hint)
            object.__setattr__(self, "window", window)
        if self.positions not in ("global", "rolling"):
            raise ValueError(f"positions must be 'global' or 'rolling', got {self.positions!r}")

    @property
    def budget(self) -> int | None:
        """``B = sink + window`` entries held once full; ``None`` for a full cache."""
        return None if self.window is None else self.sink + self.window

    @property
    def evicts(self) -> bool:
        return self.window is not None

    def to_dict(self) -> dict:
        return {"sink": self.sink, "window": self.window, "positions": self.positions}


def analytic_kv_budget_bytes(model: Any, config: SinkWindowConfig) -> int | None:
    """``B × layers × kv_heads × head_dim × dtype_bytes × 2`` (None for a full cache) for a
    model of any registered backend (dtype of its weights: the cache stores K/V in it)."""
    if config.budget is None:
        return None
    from kakeya_lab.backends import registry

    return config.budget * registry.kv_bytes_per_token(model)
