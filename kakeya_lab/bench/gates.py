"""The prefill gates' thresholds and their check (torch-, numpy- and pandas-free, so the CLI
checks them before anything loads). The gates themselves are
:func:`kakeya_lab.bench.aggregate.prefill_bounded` (the reference engine's: last vs first
full bucket p50) and :func:`kakeya_lab.bench.aggregate.prefill_flat_vs_history` (the
stricter history-slope test)."""

from __future__ import annotations

import math

PREFILL_TOLERANCE = 0.10
# "increase": only growth beyond the tolerance fails (the reference's default);
# "both": a change beyond it either way fails.
PREFILL_DIRECTIONS = ("increase", "both")


def check_prefill_gate(tolerance: float, direction: str) -> None:
    """ValueError unless ``tolerance`` is a finite number >= 0 and ``direction`` is one of
    :data:`PREFILL_DIRECTIONS`."""
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, int | float)
        or not math.isfinite(tolerance)
        or tolerance < 0
    ):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    if direction not in PREFILL_DIRECTIONS:
        raise ValueError(
            f"direction must be one of {', '.join(PREFILL_DIRECTIONS)}, got {direction!r}"
        )
