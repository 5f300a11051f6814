"""The compiled kernels' one module: :func:`compiled`.

Every ``*.cpp`` beside this file (``rows.cpp``: the few-row product; ``step.cpp``: a layer
step's small operations; ``int4.cpp``: the ``int4-vnni`` product and layer;
``bindings.cpp``: the module; ``kernels.h`` declares what they share) is compiled into one
Python module with PyTorch's extension builder (a C++ compiler and ninja) the first time a
process asks for it, for the widest vectors the CPU has (:data:`INSTRUCTION_SETS`: AVX-512F
and DQ with FMA, else AVX2 with FMA; ``simd.h`` writes the kernels for either), in one to a
few minutes (a terminal is told why it waits), into the model store
(``$KAKEYA_LAB_HOME/kernels/build/``, one folder per sources, torch version and
installation, CPU and flags), and loaded from there afterwards. The build reads copies of
the sources kept in that folder, so checkouts at other paths (a second clone, a git
worktree) with the same sources share the build rather than rebuilding it for each other
(the builder's ninja file names the sources' paths). Where it cannot be built (neither
instruction set, no compiler or ninja, a failed build) :func:`compiled` returns None and
:func:`why_unavailable` says why; every caller then runs PyTorch's operations instead (the
same numbers to float rounding).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from kakeya_lab.results import cpu_identity

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # part of the build's identity
# name -> (the compiler's flags, the CPU flags they let it assume), the widest first
INSTRUCTION_SETS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "avx512": (["-mavx512f", "-mavx512dq", "-mfma"], ("avx512f", "avx512dq", "fma")),
    "avx2": (["-mavx2", "-mfma"], ("avx2", "fma")),
}

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: tuple[Any, str] | None = None  # (module or None, why not) once tried


def instruction_set() -> str | None:
    """The widest of :data:`INSTRUCTION_SETS` this CPU has (the one the build uses), or None."""
    flags = set(cpu_identity()["cpu_flags"])
    for name, (_, needs) in INSTRUCTION_SETS.items():
        if flags.issuperset(needs):
            return name
    return None


def flags() -> list[str]:
    """The compiler's flags for this CPU's build (:func:`instruction_set`)."""
    name = instruction_set()
    return ["-O3", *(INSTRUCTION_SETS[name][0] if name else [])]


def _build() -> tuple[Any, str]:
    if instruction_set() is None:
        wanted = " or ".join("+".join(needs) for _, needs in INSTRUCTION_SETS.values())
        return None, f"the CPU lacks {wanted}"
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        return None, f"no {' or '.join(missing)} on PATH"
    from torch.utils.cpp_extension import load

    folder = build_folder()
    digest = folder.name.removeprefix("native-")
    _log.info("building the compiled kernels into %s (once per machine)", folder)
    if sys.stderr.isatty() and not any(folder.glob("*.so")):  # a terminal waits: say why
        print(
            "kakeya-lab: compiling its kernels for this CPU (once, a minute or a few)",
            file=sys.stderr,
        )
    try:
        module = load(
            name=f"kakeya_native_{digest}",
            sources=[str(path) for path in _copied_sources(folder)],
            extra_cflags=[*flags(), "-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # a compiler error, a missing header: run without it
        return None, f"the build failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
    return module, ""


def build_folder() -> Path:
    """The folder this machine's build of the current sources lives in (created), named
    after a digest of the sources, the torch version and installation, the CPU and the
    flags."""
    from kakeya_lab.models.store import store_home

    identity = cpu_identity()
    digest = hashlib.sha256(
        "\n".join(
            [
                *(f"{source.name}\n{source.read_text()}" for source in [*SOURCES, *HEADERS]),
                torch.__version__,
                # this environment's torch, whose headers the build includes by path: two
                # environments sharing the store would otherwise rebuild it for each other
                str(Path(torch.__file__).parent),
                identity["cpu"],
                " ".join(flags()),
            ]
        ).encode()
    ).hexdigest()[:16]
    folder = store_home() / "kernels" / "build" / f"native-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _copied_sources(folder: Path) -> list[Path]:
    """The ``.cpp`` sources as copies in ``folder/src`` (with the headers they include),
    written once: the folder's name is their digest, so a copy there is always current."""
    src = folder / "src"
    src.mkdir(exist_ok=True)
    for source in [*SOURCES, *HEADERS]:
        target = src / source.name
        if not target.exists():  # written whole or not at all (processes may race here)
            tmp = src / f".{source.name}.{os.getpid()}.{threading.get_ident()}"
            tmp.write_bytes(source.read_bytes())
            tmp.replace(target)
    return [src / source.name for source in SOURCES]


def compiled() -> Any | None:
    """The compiled module (built or loaded on the first call of the process), or None
    when it cannot be built here (:func:`why_unavailable`)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
    return _loaded[0]


def why_unavailable() -> str:
    """Why :func:`compiled` is None ("" when it is not, or was not tried yet)."""
    return "" if _loaded is None else _loaded[1]


def main() -> int:
    """``python -m kakeya_lab.native.build``: build this machine's kernels now (or find the
    build), on every core, and say in one line where they are or why they cannot be built.
    Exits 0 either way: without them every caller runs PyTorch's operations. ``make test``
    runs it first, so that no test waits on the build while another process competes for
    the cores."""
    module = compiled()
    if module is None:
        print(f"kakeya-lab: compiled kernels unavailable here: {why_unavailable()}")
    else:
        print(f"kakeya-lab: compiled kernels ({instruction_set()}) in {build_folder()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
