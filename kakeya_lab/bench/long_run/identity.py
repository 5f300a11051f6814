"""What a long run is, for its checkpoint's strict resume, and a checked reading of
``checkpoint.json``.

Torch-free, so that ``kakeya-lab long-run`` compares a resume's settings with the run
folder's (and refuses a damaged checkpoint) before a model loads: the model's identity
comes from its store folder (name and ``weight_sha256``), the rest from the settings.

:func:`saved_settings` is everything that shapes a run's numbers: the model (name, weights,
backend and, for torch, the linear kernel its layers run), the arms with their caches (and
the speculative arm's proposer and draft length), the generation settings and the turn
script. A checkpoint from before the kernel was recorded says nothing about it; it was
made by a torch model on the default kernel (``aten``), which is what
:func:`check_checkpoint` takes it to be.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kakeya_lab.resume import DamagedCheckpoint, check_resume

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run.arms import Arm
    from kakeya_lab.bench.long_run.settings import LongRunSettings

# What a checkpoint made before the kernel was recorded ran on (the only kernel there was).
OLD_DEFAULT_LINEAR = "aten"


def model_identity(name: str, weight_sha256: str, backend: str, linear: str) -> dict[str, str]:
    """The model part of :func:`saved_settings`. ``linear`` (the kernel of a torch model's
    linear layers) is kept for torch only; other backends record their name instead, as
    their checkpoints always did."""
    model = {"name": name, "weight_sha256": weight_sha256}
    if backend != "torch":
        model["backend"] = backend
    else:
        model["linear"] = linear
    return model


def saved_settings(
    model: Mapping[str, str],
    arms: Mapping[str, Arm],
    user_turns: Sequence[str],
    settings: LongRunSettings,
) -> dict[str, Any]:
    """Everything that shapes a long run's numbers, as its checkpoint saves it and a resume
    compares it (not ``duration_s`` or ``checkpoint_every``, which only say how long and
    how often to save). ``model``: :func:`model_identity`."""
    script = hashlib.sha256(json.dumps(list(user_turns)).encode()).hexdigest()
    probe = settings.probe()
    saved: dict[str, Any] = {
        "model": dict(model),
        "arms": {name: arm.to_dict() for name, arm in arms.items()},
        "max_new_tokens": settings.max_new_tokens,
        "turns": {"count": len(user_turns), "sha256": script},
        "probe": asdict(probe) if probe is not None else None,
        "reprefill_cap_s": settings.reprefill_cap_s,
        "turns_per_bucket": settings.turns_per_bucket,
    }
    if settings.turn_spacing_s is not None:  # pacing shapes latencies: resume only with the same
        saved["turn_spacing_s"] = settings.turn_spacing_s
    return json.loads(json.dumps(saved))  # as it reads back from the file


def _is_int(value: object, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _problem(doc: object) -> str | None:
    """What is wrong with a checkpoint document (None: it has the shape a run writes)."""
    if not isinstance(doc, dict):
        return f"it holds a {type(doc).__name__}, not an object"
    missing = [k for k in ("next_turn", "wall_s", "rows", "arms") if k not in doc]
    if missing:
        return f"it lacks {', '.join(missing)}"
    if not isinstance(doc.get("settings"), dict | None):  # None: check_resume says so
        return "settings is not an object"
    if not _is_int(doc["next_turn"]):
        return f"next_turn is {doc['next_turn']!r}, not a count of turns"
    wall = doc["wall_s"]
    if isinstance(wall, bool) or not isinstance(wall, int | float) or not wall >= 0:
        return f"wall_s is {wall!r}, not a duration"
    if not isinstance(doc["rows"], list) or not all(isinstance(r, dict) for r in doc["rows"]):
        return "rows is not a list of objects"
    plant = doc.get("plant_len", {})
    if not isinstance(plant, dict) or not all(_is_int(n) for n in plant.values()):
        return "plant_len is not an object of token counts"
    if not isinstance(doc["arms"], dict):
        return "arms is not an object"
    for name, arm in doc["arms"].items():
        if not isinstance(arm, dict):
            return f"arm {name!r} is not an object"
        ids = arm.get("history_ids")
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            return f"arm {name!r}: history_ids is not a list of token ids"
        chat = arm.get("chat")
        if not isinstance(chat, dict) or {"messages", "rendered", "awaiting_reply"} - set(chat):
            return f"arm {name!r}: chat is not a saved chat state"
        if "stopped" not in arm or not isinstance(arm["stopped"], str | None):
            return f"arm {name!r}: stopped is missing or not text"
    return None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path`` as a run wrote it; anything else (unreadable, not JSON,
    keys missing or of the wrong type) raises :class:`~kakeya_lab.resume.DamagedCheckpoint`
    naming what is wrong."""
    try:
        doc = json.loads(path.read_bytes())
    except OSError as exc:
        raise DamagedCheckpoint(
            f"{path} cannot be read ({exc.strerror or exc}); {_WAY_ON}"
        ) from None
    except ValueError as exc:  # JSONDecodeError and undecodable bytes
        raise DamagedCheckpoint(f"{path} is not valid JSON ({exc}); {_WAY_ON}") from None
    problem = _problem(doc)
    if problem is not None:
        raise DamagedCheckpoint(f"{path} is damaged: {problem}; {_WAY_ON}")
    return doc


_WAY_ON = "use --force-new to start over, or a new folder"


def check_checkpoint(path: Path, now: Mapping[str, Any]) -> dict[str, Any]:
    """Read the checkpoint at ``path`` (:func:`read_checkpoint`) and check that it was made
    with the settings ``now`` (:func:`saved_settings`); return it. Raises
    :class:`~kakeya_lab.resume.DamagedCheckpoint` or
    :class:`~kakeya_lab.resume.ResumeMismatch` (naming every difference); reads only."""
    doc = read_checkpoint(path)
    saved = doc.get("settings")
    model = saved.get("model") if saved is not None else None
    if (
        saved is not None
        and isinstance(model, dict)
        and "backend" not in model
        and "linear" not in model
    ):
        saved = {**saved, "model": {**model, "linear": OLD_DEFAULT_LINEAR}}
    check_resume(saved, dict(now), str(path))
    missing = sorted(set(now.get("arms", {})) - set(doc["arms"]))
    if missing:
        raise DamagedCheckpoint(
            f"{path} is damaged: it holds no state for arm(s) {missing}; {_WAY_ON}"
        )
    return doc
