"""The arms of a long run: ways of serving the same conversation, side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kakeya_lab.cache import SinkWindowConfig

ARM_NAMES = ("sink_window", "full_cache", "reprefill")


@dataclass(frozen=True)
class Arm:
    """One way of serving the conversation. ``stateless``: a fresh cache every turn."""

    name: str
    config: SinkWindowConfig
    stateless: bool = False

    def to_dict(self) -> dict:
        return {"name": self.name, "config": self.config.to_dict(), "stateless": self.stateless}


def standard_arms(
    sink: int, window: int, positions: str = "global",
    names: Sequence[str] = ARM_NAMES,
) -> dict[str, Arm]:
    """``sink_window`` (our runtime, bounded cache), ``full_cache`` (the same runtime, a
    cache that never evicts) and ``reprefill`` (stateless: the whole conversation is
    prefilled into a fresh cache every turn, as an HTTP chat endpoint does).

    Raises ValueError for an unknown, repeated or missing arm name or a bad cache size
    (before any model is needed)."""
    names = list(names)
    unknown = sorted(set(names) - set(ARM_NAMES))
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(ARM_NAMES)}")
    if not names:
        raise ValueError(f"no arms given; known: {', '.join(ARM_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm is named twice in {names}")
    full = SinkWindowConfig(sink=0, window=None)
    known = {
        "full_cache": Arm("full_cache", full),
        "reprefill": Arm("reprefill", full, stateless=True),
    }
    if "sink_window" in names:
        known["sink_window"] = Arm("sink_window", SinkWindowConfig(sink=sink, window=window, positions=positions))
    return {n: known[n] for n in names}
