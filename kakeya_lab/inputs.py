"""One input policy for token ids, counts and sizes (checked before any state changes).

* Token ids: Python ints or numpy integer scalars; never bools, floats or strings. A tensor
  or array must be 1-D (a 2-D one is refused, not flattened); the ids must be non-empty and
  inside the vocabulary ``0..vocab_size-1``.
* Counts (``max_new_tokens``, ``capacity``, draft length, ``commit(n)``, ``prefill_chunk``,
  ``top_k``...): ints (not bool, not float) within stated bounds.
* Sizes (``sink``, ``window``): counts bounded by what a machine can hold (:data:`MAX_SIZE`).

Every check raises :class:`InputTypeError` (wrong kind; both a ``TypeError`` and a
``ValueError``, so callers catching either see it) or ``ValueError`` (wrong value), with
a message naming the argument, what was given and what to do.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np

from kakeya_lab.errors import InputTypeError

MAX_SIZE = 2**31 - 1  # positions are int64 but no machine holds more tokens than this


def _is_torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch (a tensor cannot exist
    before torch was imported), so checks of plain values stay cheap."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _kind(value: object) -> str:
    return type(value).__name__


def is_integer(value: object) -> TypeGuard[int | np.integer[Any]]:
    """A Python int or numpy integer scalar (bools are not integers here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(
    value: object, name: str, *, minimum: int = 0, maximum: int | None = None, hint: str = ""
) -> int:
    """``value`` as an int in ``[minimum, maximum]``, or an error naming ``name`` (``hint``
    is appended to the message)."""
    hint = f" ({hint})" if hint else ""
    if not is_integer(value):
        shown = f" {value!r}" if isinstance(value, (bool, float, str)) else ""
        raise InputTypeError(f"{name} must be an integer, got {_kind(value)}{shown}{hint}")
    n = int(value)
    if n < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {n}{hint}")
    if maximum is not None and n > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {n}{hint}")
    return n


def size(value: object, name: str, *, minimum: int = 0, hint: str = "") -> int:
    """A count bounded by :data:`MAX_SIZE` (a cache size, a window)."""
    if is_integer(value) and int(value) > MAX_SIZE:
        raise ValueError(
            f"{name} = {int(value)} is larger than any machine can hold (max {MAX_SIZE})"
        )
    return count(value, name, minimum=minimum, hint=hint)


def number(
    value: object, name: str, *, minimum: float | None = None, strict: bool = False
) -> float:
    """A finite real number (int or float, not bool) ``>= minimum`` (``> minimum`` if ``strict``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise InputTypeError(f"{name} must be a number, got {_kind(value)}")
    x = float(value)
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {x}")
    if minimum is not None and (x <= minimum if strict else x < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}, got {x}")
    return x


def stop_token_ids(value: object, vocab_size: int) -> frozenset[int]:
    """Stop ids: None or a (possibly empty) collection of in-vocabulary integers."""
    if value is None:
        return frozenset()
    if isinstance(value, (str, bytes)):
        raise InputTypeError(
            f"stop_token_ids must be a collection of token ids, not a {_kind(value)} {value!r} "
            "(tokenize the stop text first)"
        )
    if isinstance(value, (list, tuple, set, frozenset)) and not value:
        return frozenset()
    return frozenset(token_ids(value, vocab_size, "stop_token_ids"))


def token_ids(value: object, vocab_size: int, name: str = "token ids") -> list[int]:
    """``value`` as a non-empty list of ints inside ``0..vocab_size-1``.

    Accepts a sequence of ints / numpy integer scalars, or a 1-D integer tensor or array.
    """
    if isinstance(value, (str, bytes)):
        raise InputTypeError(
            f"{name} must be a sequence of integers, not a {_kind(value)} (tokenize it first)"
        )
    tensor = _is_torch_tensor(value)
    if tensor or isinstance(value, np.ndarray):
        array: Any = value  # a tensor or an array (torch's type is not imported here)
        if array.ndim != 1:
            raise ValueError(
                f"{name} must be 1-D, got a {array.ndim}-D {_kind(array)} of shape {tuple(array.shape)} "
                "(pass one sequence, e.g. ids[0])"
            )
        if tensor:
            if array.is_floating_point() or array.is_complex() or str(array.dtype) == "torch.bool":
                raise InputTypeError(f"{name} must be an integer tensor, got dtype {array.dtype}")
            ids = array.tolist()
        else:
            if array.dtype.kind not in "iu":
                raise InputTypeError(f"{name} must be an integer array, got dtype {array.dtype}")
            ids = [int(t) for t in array.tolist()]
    elif isinstance(value, Sequence) or hasattr(value, "__iter__"):
        ids = list(value)
    else:
        raise InputTypeError(f"{name} must be a sequence of integers, got {_kind(value)}")
    if not ids:
        raise ValueError(f"empty {name}: nothing to append")
    for i, t in enumerate(ids):
        if not is_integer(t):
            shown = f" {t!r}" if isinstance(t, (bool, float, str, numbers.Number)) else ""
            raise InputTypeError(f"{name}[{i}] must be an integer, got {_kind(t)}{shown}")
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{len(bad)} token id(s) outside the vocabulary 0..{vocab_size - 1}: {bad[:5]}"
        )
    return ids
