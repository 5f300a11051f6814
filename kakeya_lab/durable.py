"""Durable files: the one atomic writer of the package.

Every file the workbench writes for a reader (result JSON, CSV tables, Parquet indexes,
figures, manifests) goes through :func:`write_atomic`:

* the content is written to a temp file ``.<name>.<random>.tmp`` in the target folder,
  flushed and fsynced, then renamed over the target, and the folder is fsynced, so a
  reader (or a crash) sees either the old file or the whole new one, never a part;
* the file gets the permissions a plain ``open(path, "w")`` would give (``0666`` minus
  the umask, typically ``0644``), not ``mkstemp``'s private ``0600``;
* temp files a killed writer left in a folder are removed the next time anything is
  written there (:func:`remove_stale_temp_files`). A temp file is named
  ``.<name>.<pid>.<random>.tmp``; it is stale when that process no longer runs (or,
  for a name without a pid, when it is older than ``STALE_AFTER_S``), so a concurrent
  writer's live temp file is left alone.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

TEMP_SUFFIX = ".tmp"
STALE_AFTER_S = 3600.0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(folder: str | Path) -> None:
    """Make a rename inside ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _is_stale(path: Path, now: float, older_than_s: float) -> bool:
    parts = path.name.split(".")  # ['', name..., pid, random, 'tmp']
    if len(parts) >= 5 and parts[-3].isdigit():
        pid = int(parts[-3])
        if pid != os.getpid() and not _pid_alive(pid):
            return True
    return now - path.stat().st_mtime >= older_than_s


def remove_stale_temp_files(
    folder: str | Path, *, older_than_s: float = STALE_AFTER_S
) -> list[Path]:
    """Delete the ``.*.tmp`` files in ``folder`` that a killed writer left behind (its
    process is gone, or the file is older than ``older_than_s``). Returns what was removed."""
    folder = Path(folder)
    removed: list[Path] = []
    now = time.time()
    try:
        candidates = list(folder.glob(f".*{TEMP_SUFFIX}"))
    except OSError:
        return removed
    for path in candidates:
        try:
            if path.is_file() and _is_stale(path, now, older_than_s):
                path.unlink()
                removed.append(path)
        except OSError:
            continue
    return removed


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Create or replace ``path`` atomically; ``write(fh)`` fills a binary file object.

    The folder is created if needed. On any exception (a kill included, at the next
    write in the folder) no partial file is left at ``path`` and the old one survives.
    """
    path = Path(path)
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(folder)
    tmp = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
    mode = 0o666 & ~_umask()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(folder)
    return path


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """:func:`write_atomic` of a bytes object."""
    return write_atomic(path, lambda fh: fh.write(data))


def write_text_atomic(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """:func:`write_atomic` of a string."""
    return write_bytes_atomic(path, text.encode(encoding))


def finite(obj: Any) -> Any:
    """NaN and infinities become None (JSON has no such numbers; pandas makes them for gaps)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return finite(obj.item())
    return obj


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def to_json_text(obj: Any) -> str:
    """Indented JSON of ``obj`` (numpy scalars and arrays, paths; non-finite floats -> null)."""
    return json.dumps(finite(obj), indent=2, default=_jsonable, allow_nan=False) + "\n"


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as JSON atomically (non-finite floats are written as null)."""
    return write_text_atomic(path, to_json_text(obj))


def write_csv_atomic(path: str | Path, table: Any, **to_csv_kwargs: Any) -> Path:
    """Write a pandas DataFrame as CSV atomically (``index=False`` unless given)."""
    to_csv_kwargs.setdefault("index", False)
    return write_atomic(path, lambda fh: table.to_csv(fh, **to_csv_kwargs))


def write_parquet_atomic(path: str | Path, table: Any, **to_parquet_kwargs: Any) -> Path:
    """Write a pandas DataFrame as Parquet atomically (``index=False`` unless given)."""
    to_parquet_kwargs.setdefault("index", False)
    return write_atomic(path, lambda fh: table.to_parquet(fh, **to_parquet_kwargs))
