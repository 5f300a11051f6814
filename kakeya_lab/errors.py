"""Error types shared by every layer, importable without a tensor library."""

from __future__ import annotations


class InputTypeError(TypeError, ValueError):
    """An argument of the wrong kind (a float where an integer belongs, a string...)."""
