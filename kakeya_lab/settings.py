"""Settings: an experiment's parameters as one frozen value, validated once.

A family's settings (e.g. :class:`~kakeya_lab.bench.long_run.settings.LongRunSettings`) is
a frozen dataclass deriving from :class:`Settings`. Its ``validate()`` runs once, in
``__post_init__``, and raises :class:`SettingsError` (a ValueError naming the field) for
anything that cannot work; code below it takes the value as valid and does not re-check.
The same value is what the CLI builds from its flags, what a notebook builds from its
parameters cell, what a run folder's ``run.json`` and ``metrics.json`` record
(:meth:`Settings.to_dict`) and what a resume compares (:meth:`Settings.from_dict`).

Torch-free: the CLI checks its arguments with it before anything heavy loads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from kakeya_lab.linear_kernels import FULL_PRECISION

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations only, so 3.10 imports this module

__all__ = ["Settings", "SettingsError", "check_int", "check_kernels", "check_positive"]


class SettingsError(ValueError):
    """A setting that cannot work. ``field``: its name; ``problem``: what is wrong with it
    (the message is ``"{field} {problem}"``, so a CLI can name its flag instead)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


def check_int(field: str, value: object, minimum: int) -> None:
    """Raise :class:`SettingsError` unless ``value`` is an integer (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise SettingsError(field, f"must be an integer, got {value!r}")
    if value < minimum:
        raise SettingsError(field, f"must be >= {minimum}, got {value!r}")


def check_kernels(linear: object, plain_kernels: tuple[object, ...]) -> None:
    """Raise :class:`SettingsError` unless ``linear`` (the verifier's linear kernel) is a
    full-precision kernel or ``"auto"`` and every one of ``plain_kernels`` (those plain
    decoding is timed on) is full-precision: a quantised verifier would be another model
    than the plain decoding timed beside it."""
    if linear not in (*FULL_PRECISION, "auto"):
        raise SettingsError(
            "linear",
            f"must be a full-precision kernel or 'auto' ({', '.join(FULL_PRECISION)}, auto), "
            f"got {linear!r}",
        )
    for kernel in plain_kernels:
        if kernel not in FULL_PRECISION:
            raise SettingsError(
                "plain_kernels",
                f"must name full-precision kernels ({', '.join(FULL_PRECISION)}), got {kernel!r}",
            )


def check_positive(field: str, value: object, *, optional: bool = True) -> None:
    """Raise :class:`SettingsError` unless ``value`` is a finite number > 0 (or None when
    ``optional``)."""
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not value > 0
    ):
        raise SettingsError(field, f"must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of every family's settings: frozen, validated once on construction, and
    round-tripped through plain JSON (:meth:`to_dict` / :meth:`from_dict`)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # lists from JSON or a notebook become tuples
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`SettingsError` for a setting that cannot work (override)."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (tuples as lists)."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        """The settings ``values`` describe (missing fields take their defaults); unknown
        names raise :class:`SettingsError` (a typo must not silently run a default)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SettingsError(
                ", ".join(unknown), f"unknown to {cls.__name__}; known: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def differences(self, other: Settings) -> list[str]:
        """``"name: was A, now B"`` for every field where ``other`` (the saved settings)
        differs from these (the ones asked for now)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [
            f"{k}: was {theirs.get(k)!r}, now {mine.get(k)!r}"
            for k in sorted(set(mine) | set(theirs))
            if mine.get(k) != theirs.get(k)
        ]
