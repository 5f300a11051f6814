"""Loading a model offline: registry name, local safetensors folder or cached Hub id.

:func:`load_model` loads a registry name (pulling it if missing), a local folder holding
``*.safetensors``, or a Hub id already in the local Hugging Face cache. It never reaches the
Hub, never sets ``trust_remote_code`` and loads weights from safetensors only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kakeya_lab.linear import check_linear_kernel, linear_kernel_of, set_linear_kernel
from kakeya_lab.models.dims import config_dims, model_dims
from kakeya_lab.models.errors import (
    ModelStoreError,
    UnsupportedModelError,
)
from kakeya_lab.models.memory import place_weights
from kakeya_lab.models.pull import transformers_progress
from kakeya_lab.models.registry import DEFAULT_MODEL
from kakeya_lab.models.resolve import ResolvedFolder, resolve

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
