"""Loading a model offline: registry name, local safetensors folder or cached Hub id.

:func:`load_model` loads a registry name (pulling it if missing), a local folder holding
``*.safetensors``, or a Hub id already in the local Hugging Face cache. It never reaches the
Hub, never sets ``trust_remote_code`` and loads weights from safetensors only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kakeya_lab.linear import check_linear_kernel, linear_kernel_of, set_linear_kernel
from kakeya_lab.models.dims import config_dims, model_dims
from kakeya_lab.models.errors import (
    ModelNotAvailableError,
    ModelStoreError,
    UnsupportedModelError,
)
from kakeya_lab.models.memory import place_weights
from kakeya_lab.models.pull import pull, transformers_progress
from kakeya_lab.models.registry import DEFAULT_MODEL, REGISTRY
from kakeya_lab.models.store import (
    MANIFEST_NAME,
    folder_present,
    model_dir,
    safetensors_files,
    weight_sha256,
)
from kakeya_lab.models.verify import verify_folder

__all__ = ["LoadedModel", "ModelDescription", "load_model"]


@dataclass(frozen=True)
class ModelDescription:
    """What a loaded model is, for result files and figures.

    ``weight_sha256`` is :func:`weight_sha256` of the folder for models loaded from disk and a
    hash of the state-dict bytes for random models. ``random`` is True for randomly
    initialised models (never to be read as quality). ``path`` is the folder loaded from (""
    for random models). ``source`` says where it came from (``registry:NAME (...)``,
    ``local:PATH``, ``hf-cache:ID`` or ``random-init ...``). ``dtype`` is the in-memory
    dtype, e.g. ``"float32"``. ``backend`` is the runtime holding the weights: ``"torch"``
    or ``"mlx"`` (same files, same ``weight_sha256``). ``blas`` is, for MLX, the BLAS its
    CPU backend calls (:func:`kakeya_lab.blas.mlx_blas`); "" for torch. ``linear`` is, for
    torch, the kernel its linear layers run (``"aten"``, ``"onednn"``, ``"auto"``, ``"int8"`` or
    ``"int4"``, :mod:`kakeya_lab.linear`); "" for MLX.
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
    backend: str = "torch"
    blas: str = ""
    linear: str = ""

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


def as_torch_dtype(dtype: torch.dtype | str, folder: Path | None = None) -> torch.dtype:
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
    if not safetensors_files(folder):
        raise ModelNotAvailableError(
            f"{folder} holds no *.safetensors weights; only safetensors folders are loaded "
            "(no .bin/.pt pickles, no GGUF: use `kakeya-lab models pull NAME` for registry models)"
        )
    if not (folder / "config.json").is_file():
        raise ModelNotAvailableError(f"{folder} has no config.json")


def _looks_like_hub_id(s: str) -> bool:
    """``name`` or ``org/name`` made of letters, digits, ``_``, ``-`` and ``.``."""
    return not s.startswith((".", "~")) and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", s) is not None


@dataclass(frozen=True)
class ResolvedFolder:
    """A model folder found offline: ``folder``, display ``name``, ``source`` (see
    :class:`ModelDescription`) and the ``weight_sha256`` of its safetensors files (the
    manifest's, verified, for folders with a manifest; computed otherwise)."""

    folder: Path
    name: str
    source: str
    weight_sha256: str


def resolve(
    name_or_path: str, *, pull_if_missing: bool, progress: bool, verify: bool = False
) -> ResolvedFolder:
    """Find and verify the folder of a registry name, local folder or cached Hub id.

    A folder with a ``manifest.json`` (every registry store folder) is checked with
    :func:`~kakeya_lab.models.verify.verify_folder` (``full=verify``) before anything is
    read from it: :class:`CorruptModelError` naming the file and the repair otherwise.
    """
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
        folder = model_dir(spec.name)
        if not folder_present(folder):
            if not pull_if_missing:
                raise ModelNotAvailableError(
                    f"model {spec.name!r} is not pulled; run `kakeya-lab models pull {spec.name}`"
                )
            folder = pull(spec.name, progress=progress)
        checked = verify_folder(folder, full=verify, name=spec.name)
        _check_safetensors_folder(folder)
        return ResolvedFolder(
            folder,
            spec.name,
            f"registry:{spec.name} ({spec.source}, gguf sha256 {spec.gguf_sha256})",
            checked.manifest["weight_sha256"],
        )
    path = Path(name_or_path).expanduser()
    if path.exists():
        path = path.resolve()
        if (path / MANIFEST_NAME).exists():
            manifest = verify_folder(path, full=verify).manifest
            _check_safetensors_folder(path)
            name = str(manifest.get("name") or path.name)
            return ResolvedFolder(path, name, f"local:{path}", manifest["weight_sha256"])
        _check_safetensors_folder(path)
        return ResolvedFolder(path, path.name, f"local:{path}", weight_sha256(path))
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
    return ResolvedFolder(
        snapshot, name_or_path, f"hf-cache:{name_or_path}", weight_sha256(snapshot)
    )


def enable_sink_window(model: Any) -> None:
    from kakeya_lab.backends.torch_attention import enable_sink_window_attention

    enable_sink_window_attention(model)


def describe(
    model: Any, *, name: str, path: str, sha: str, random: bool, source: str
) -> ModelDescription:
    """The :class:`ModelDescription` of a loaded transformers ``model``."""
    dims = model_dims(model)
    return ModelDescription(
        name=name,
        path=path,
        weight_sha256=sha,
        architecture=type(model).__name__,
        num_layers=dims.num_layers,
        num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        num_attention_heads=dims.num_attention_heads,
        hidden_size=dims.hidden_size,
        vocab_size=dims.vocab_size,
        dtype=str(model.dtype).removeprefix("torch."),
        random=random,
        source=source,
        linear=linear_kernel_of(model),
    )


def _require_mlx() -> None:
    missing = [m for m in ("mlx", "mlx_lm") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelStoreError(
            f"backend='mlx' needs {' and '.join(missing)}, which is not installed: "
            "pip install 'kakeya_lab[mlx]' (or use backend='torch')"
        )


def _load_mlx(found: ResolvedFolder, tokenizer: Any, dtype: torch.dtype | str) -> LoadedModel:
    """Load the verified folder ``found`` with :mod:`kakeya_lab.backends.mlx_backend`."""
    from transformers import AutoConfig

    from kakeya_lab.blas import mlx_blas

    dtype_name = str(as_torch_dtype(dtype, found.folder)).removeprefix("torch.")
    try:
        mlx_backend = importlib.import_module("kakeya_lab.backends.mlx_backend")
    except ModuleNotFoundError as exc:
        if exc.name != "kakeya_lab.backends.mlx_backend":
            raise
        raise ModelStoreError(
            "backend='mlx' needs kakeya_lab.backends.mlx_backend, which this kakeya_lab does not have; "
            "use backend='torch'"
        ) from None
    try:
        model = mlx_backend.load_mlx_model(found.folder, dtype_name)
    except ValueError as exc:
        raise UnsupportedModelError(
            f"{found.name}: the MLX backend cannot load it ({exc}); use backend='torch'"
        ) from exc
    config = AutoConfig.from_pretrained(str(found.folder), local_files_only=True)
    dims = config_dims(config)
    description = ModelDescription(
        name=found.name,
        path=str(found.folder),
        weight_sha256=found.weight_sha256,
        architecture=(getattr(config, "architectures", None) or ["?"])[0],
        num_layers=dims.num_layers,
        num_kv_heads=dims.num_kv_heads,
        head_dim=dims.head_dim,
        num_attention_heads=dims.num_attention_heads,
        hidden_size=dims.hidden_size,
        vocab_size=dims.vocab_size,
        dtype=dtype_name,
        random=False,
        source=found.source,
        backend="mlx",
        blas=mlx_blas(),
    )
    return LoadedModel(model, tokenizer, description)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    backend: str = "torch",
    dtype: torch.dtype | str = torch.float32,
    *,
    pull_if_missing: bool = True,
    verify: bool = False,
    progress: bool = True,
    linear: str = "aten",
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

    Weights load with ``use_safetensors=True``; ``trust_remote_code`` is never set; they are
    then placed in huge pages, in the order a step reads them
    (:func:`kakeya_lab.models.memory.place_weights`). ``dtype``
    is a torch dtype or a name (``"float32"``, ``"bf16"``, ..., ``"auto"`` for the stored
    dtype). The model is put in eval mode and switched to the sink-window attention
    (:func:`kakeya_lab.backends.torch_attention.enable_sink_window_attention`). ``linear`` is the kernel its
    linear layers run (torch only): ``"aten"`` (PyTorch's default), ``"onednn"`` (oneDNN's,
    cheaper for blocks of a few rows on some CPUs), ``"split"`` (products over the threads),
    ``"exact"`` (``split``'s numbers, each weight read from its exact 4- or 8-bit form where
    it has one), ``"auto"`` (the fastest of these on this machine for each row count,
    measured once and cached: :mod:`kakeya_lab.linear_auto`) or
    ``"int8"``/``"int4"`` (quantised copies of
    the weights for a draft model: cheaper steps, changed numbers; :mod:`kakeya_lab.linear`);
    ``ValueError`` for another name, before anything is loaded.

    Verification (before anything is read): a folder with a ``manifest.json`` (every registry
    store folder) must hold every file the manifest lists with the recorded size and sha256,
    else :class:`CorruptModelError` names the file and the repair (``kakeya-lab models pull
    NAME --force``, ``kakeya-lab models verify NAME``). By default a file whose size, mtime,
    ctime and inode are unchanged since it was last hashed is trusted (cheap: a ``stat`` per
    file); a changed file is re-hashed. ``verify=True`` re-hashes every file. See
    :mod:`kakeya_lab.models.verify` for the residual risk of the cheap check.

    ``description.weight_sha256``: for a folder with a manifest, the manifest's value
    (verified as above); for other folders it is computed from the files.

    ``progress`` shows progress bars (a pull, transformers' weight loading).

    ``backend="mlx"`` resolves and verifies the same folder in the same way (no second
    download or conversion), loads the tokenizer with transformers and the weights with
    :func:`kakeya_lab.backends.mlx_backend.load_mlx_model` in ``dtype`` (same names; ``"auto"`` is
    the stored dtype). The description has ``backend="mlx"`` and the same ``weight_sha256``.
    Without ``mlx``/``mlx-lm`` installed: :class:`ModelStoreError` naming the extra
    (``pip install 'kakeya_lab[mlx]'``); an architecture the MLX backend does not implement:
    :class:`UnsupportedModelError`.
    """
    from kakeya_lab.backends import registry

    if backend not in registry.names():
        raise ModelStoreError(
            f"unknown backend {backend!r}; use one of {', '.join(registry.names())}"
        )
    check_linear_kernel(linear)
    if backend == "mlx":
        if linear != "aten":
            raise ValueError(f"linear={linear!r} is a torch kernel; the MLX backend has its own")
        _require_mlx()
    found = resolve(
        str(name_or_path), pull_if_missing=pull_if_missing, progress=progress, verify=verify
    )
    folder = found.folder

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = as_torch_dtype(dtype, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if backend == "mlx":
        return _load_mlx(found, tokenizer, dtype)
    with transformers_progress(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch_dtype, use_safetensors=True, local_files_only=True
        )
    model.eval()
    place_weights(model)
    enable_sink_window(model)
    if linear == "auto":
        from kakeya_lab.linear_auto import set_auto_kernel

        set_auto_kernel(model, identity=found.weight_sha256)
    else:
        set_linear_kernel(model, linear)
    description = describe(
        model,
        name=found.name,
        path=str(folder),
        sha=found.weight_sha256,
        random=False,
        source=found.source,
    )
    return LoadedModel(model, tokenizer, description)
