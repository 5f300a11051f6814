"""The package's own proposer kinds, registered like any other (:func:`register_proposer`).

Each names its builder by path, so listing the kinds (the CLI's help, the server's
allow-list) imports no model code; the builder's module is imported when one is built.
"""

from __future__ import annotations

from kakeya_lab.linear_kernels import KERNELS
from kakeya_lab.proposers.registry import ProposerKind, register_proposer

MAX_SUFFIX_DEPTH = 64


def draft_model_spec(argument: str) -> tuple[str, str | None]:
    """Split the ``MODEL[:KERNEL]`` of a ``draft:`` spec into the model and its linear
    kernel (one of :data:`kakeya_lab.linear_kernels.KERNELS`, ``None`` when not given).

    ``qwen2.5-coder-0.5b-instruct:int4`` → ``("qwen2.5-coder-0.5b-instruct", "int4")``; a
    last ``:`` part that is not a kernel name stays in the model (a folder may hold one).
    """
    name, colon, kernel = argument.rpartition(":")
    if colon and kernel in KERNELS:
        return name, kernel
    return argument, None


def check_ngram_sizes(spec: str, argument: str) -> None:
    """``SIZES``: comma-separated n-gram sizes >= 1 (optional)."""
    if argument and not all(n.strip().isdigit() and int(n) >= 1 for n in argument.split(",")):
        kind = spec.partition(":")[0]
        raise ValueError(f"bad n-gram sizes in {spec!r}: write them like {kind}:3,2,1")


def check_suffix_depth(spec: str, argument: str) -> None:
    """``DEPTH``: the suffix index's depth, 1 to :data:`MAX_SUFFIX_DEPTH` (optional)."""
    if argument and not (argument.isdigit() and 1 <= int(argument) <= MAX_SUFFIX_DEPTH):
        kind = spec.partition(":")[0]
        raise ValueError(
            f"bad suffix depth in {spec!r}: write it like {kind}:8 (1 to {MAX_SUFFIX_DEPTH})"
        )


def check_layer_count(spec: str, argument: str) -> None:
    """``LAYERS``: how many of the verifier's layers draft (required)."""
    if not (argument.isdigit() and int(argument) >= 1):
        raise ValueError(f"bad layer count in {spec!r}: write it like early-exit:8")


def check_draft_model(spec: str, argument: str) -> None:
    """``MODEL[:KERNEL]``: a registry name or local folder, and optionally its kernel."""
    if not argument or not draft_model_spec(argument)[0]:
        raise ValueError(
            f"no draft model in {spec!r}: write it like draft:MODEL or draft:MODEL:int4"
        )


def check_drafter_name(spec: str, argument: str) -> None:
    """``NAME``: a named drafter of the store (looked up by the caller)."""
    if not argument:
        kind = spec.partition(":")[0]
        raise ValueError(f"no drafter name in {spec!r}: write it like {kind}:NAME")


NGRAM = register_proposer(
    ProposerKind(
        name="ngram",
        usage="ngram[:SIZES]",
        summary="prompt lookup: what followed the latest earlier occurrence of the last n-gram",
        build="kakeya_lab.proposers.ngram:build",
        check=check_ngram_sizes,
    )
)
SUFFIX = register_proposer(
    ProposerKind(
        name="suffix",
        usage="suffix[:DEPTH]",
        summary="continuation counts over the history and every reply of the store",
        build="kakeya_lab.proposers.suffix:build",
        check=check_suffix_depth,
    )
)
EARLY_EXIT = register_proposer(
    ProposerKind(
        name="early-exit",
        usage="early-exit:LAYERS",
        summary="the verifier's first LAYERS layers with its final norm and lm_head",
        build="kakeya_lab.proposers.early_exit:build",
        check=check_layer_count,
        needs="verifier",
        example="early-exit:8",
    )
)
DRAFT = register_proposer(
    ProposerKind(
        name="draft",
        usage="draft:MODEL[:KERNEL]",
        summary="a smaller model sharing the tokenizer, with its own cache",
        build="kakeya_lab.proposers.draft_model:build",
        check=check_draft_model,
        needs="draft model",
        example="draft:smollm2-135m-instruct:int4",
    )
)
DRAFTER = register_proposer(
    ProposerKind(
        name="drafter",
        usage="drafter:NAME",
        summary="a trained drafter reading the verifier's hidden states",
        build="kakeya_lab.proposers.drafters.proposer:build_chain",
        check=check_drafter_name,
        needs="named drafter",
        backends=("torch",),
        example="drafter:NAME",
    )
)
DRAFTER_TREE = register_proposer(
    ProposerKind(
        name="drafter-tree",
        usage="drafter-tree:NAME",
        summary="a trained feature drafter's EAGLE-2 draft tree",
        build="kakeya_lab.proposers.drafters.proposer:build_tree",
        check=check_drafter_name,
        needs="named drafter",
        tree=True,
        backends=("torch",),
        example="drafter-tree:NAME",
    )
)
NGRAM_TREE = register_proposer(
    ProposerKind(
        name="ngram-tree",
        usage="ngram-tree[:SIZES]",
        summary="prompt lookup over every recent occurrence, as a draft tree",
        build="kakeya_lab.proposers.trees:build_ngram_tree",
        check=check_ngram_sizes,
        tree=True,
    )
)
SUFFIX_TREE = register_proposer(
    ProposerKind(
        name="suffix-tree",
        usage="suffix-tree[:DEPTH]",
        summary="the suffix index's likeliest continuations, as a draft tree",
        build="kakeya_lab.proposers.trees:build_suffix_tree",
        check=check_suffix_depth,
        tree=True,
    )
)
TREE = register_proposer(
    ProposerKind(
        name="tree",
        usage="tree:SPEC",
        summary="any chain proposer verified as a 1-wide draft tree",
        build="kakeya_lab.proposers.trees:build_chain_tree",
        tree=True,
        wraps=True,
        example="tree:ngram",
    )
)
