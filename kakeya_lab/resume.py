"""Strict resume: a checkpointed run continues only with the settings it was started with.

Each resumable run (long run, sweep, drafter training) saves the settings that shape its
numbers beside its checkpoint; on resume :func:`check_resume` compares them with the
settings asked for now and raises :class:`ResumeMismatch` naming every difference; a
checkpoint that cannot be read back is a :class:`DamagedCheckpoint`. Both are
:class:`ResumeError`; the way on is a new folder or ``--force-new`` (start over in the same
folder).
"""

from __future__ import annotations

from typing import Any


class ResumeError(ValueError):
    """A checkpoint that cannot be resumed: the user's to settle (start over, another folder)."""


class ResumeMismatch(ResumeError):
    """A checkpoint was made with other settings than the ones asked for now."""


class DamagedCheckpoint(ResumeError):
    """A checkpoint that cannot be read back as its run wrote it (truncated, not JSON, keys
    missing or of the wrong type)."""


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): obj}


def differences(saved: dict, now: dict) -> str:
    """``"key: was A, now B; ..."`` for every leaf that differs ('' if none)."""
    a, b = _flatten(saved), _flatten(now)
    parts = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            parts.append(
                f"{key}: was {_short(a.get(key, '<absent>'))}, now {_short(b.get(key, '<absent>'))}"
            )
    return "; ".join(parts)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_resume(saved: dict | None, now: dict, where: str) -> None:
    """Raise :class:`ResumeMismatch` if the ``saved`` settings differ from ``now``.

    ``saved`` None (a checkpoint from before settings were recorded) is refused too: such
    a checkpoint cannot prove it matches.
    """
    if saved is None:
        raise ResumeMismatch(
            f"{where} records no run settings, so it cannot be resumed safely; "
            "use --force-new to start over or a new folder"
        )
    diff = differences(saved, now)
    if diff:
        raise ResumeMismatch(
            f"{where} was made with other settings ({diff}); rerun with the same settings, "
            "or use --force-new to start over, or a new folder"
        )
