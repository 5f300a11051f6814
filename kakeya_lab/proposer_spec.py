"""The proposer spec: the short strings that name a proposer (CLI, notebooks, sweep files,
the chat panel, the servers), checked without loading a model.

:func:`~kakeya_lab.proposers.make_proposer` builds a proposer from one;
:func:`check_proposer_spec` says whether one is well formed and returns its leaves, so a
caller can look the models and drafters it names up before anything loads.
"""

from __future__ import annotations

USAGE = (
    "use none, ngram[:SIZES], suffix[:DEPTH], early-exit:LAYERS, draft:MODEL[:KERNEL], "
    "drafter:NAME, drafter-tree:NAME, ngram-tree[:SIZES], suffix-tree[:DEPTH], tree:SPEC "
    "or FIRST+SECOND"
)
TREE_KINDS = ("tree", "ngram-tree", "suffix-tree", "drafter-tree")
MAX_SUFFIX_DEPTH = 64


def draft_model_spec(arg: str) -> tuple[str, str | None]:
    """Split the ``MODEL[:KERNEL]`` of a ``draft:`` spec into the model and its linear
    kernel (one of :data:`kakeya_lab.linear.KERNELS`, ``None`` when not given).

    ``qwen2.5-coder-0.5b-instruct:int4`` → ``("qwen2.5-coder-0.5b-instruct", "int4")``; a
    last ``:`` part that is not a kernel name stays in the model (a folder may hold one).
    """
    from kakeya_lab.linear import KERNELS  # torch: only for draft specs, so help stays cheap

    name, colon, kernel = arg.rpartition(":")
    if colon and kernel in KERNELS:
        return name, kernel
    return arg, None


def check_proposer_spec(spec: str | None) -> list[tuple[str, str]]:
    """The ``(kind, argument)`` leaves of a well-formed proposer spec (``[]`` for ``none``,
    ``""`` or ``None``: plain decoding); raises ValueError, saying how to write it, for any
    other spec. ``tree:ngram`` is the leaf ``("ngram", "")``; ``suffix+draft:M`` two leaves.

    Models and named drafters are not looked up here (the CLI does that for the leaves)."""
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"proposer spec must be a string or None, got {type(spec).__name__}")
    if spec in (None, "", "none"):
        return []
    assert spec is not None
    if "+" in spec:  # FIRST+SECOND: two chain proposers
        first, _, second = spec.partition("+")
        leaves = []
        for part in (first, second):
            if part in ("", "none") or part.partition(":")[0] in TREE_KINDS:
                raise ValueError(f"FIRST+SECOND combines two chain proposers, got {spec!r}")
            leaves += check_proposer_spec(part)
        return leaves
    kind, _, arg = spec.partition(":")
    if kind == "tree":  # a chain proposer verified as a 1-wide tree
        if not arg or arg in ("none",) or arg.partition(":")[0] in TREE_KINDS or "+" in arg:
            raise ValueError(f"tree:SPEC wraps one chain proposer, got {spec!r}")
        return check_proposer_spec(arg)
    if kind in ("ngram", "ngram-tree"):
        if arg and not all(n.strip().isdigit() and int(n) >= 1 for n in arg.split(",")):
            raise ValueError(f"bad n-gram sizes in {spec!r}: write them like {kind}:3,2,1")
    elif kind in ("suffix", "suffix-tree"):
        if arg and not (arg.isdigit() and 1 <= int(arg) <= MAX_SUFFIX_DEPTH):
            raise ValueError(
                f"bad suffix depth in {spec!r}: write it like {kind}:8 (1 to {MAX_SUFFIX_DEPTH})"
            )
    elif kind == "early-exit":
        if not (arg.isdigit() and int(arg) >= 1):
            raise ValueError(f"bad layer count in {spec!r}: write it like early-exit:8")
    elif kind == "draft":
        if not arg or not draft_model_spec(arg)[0]:
            raise ValueError(
                f"no draft model in {spec!r}: write it like draft:MODEL or draft:MODEL:int4"
            )
    elif kind in ("drafter", "drafter-tree"):
        if not arg:
            raise ValueError(f"no drafter name in {spec!r}: write it like {kind}:NAME")
    else:
        raise ValueError(f"unknown proposer {spec!r}: {USAGE}")
    return [(kind, arg)]
