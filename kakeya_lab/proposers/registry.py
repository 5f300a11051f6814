"""The proposer registry: every kind of proposer, by the name its spec starts with.

A proposer spec is the short string that names a proposer wherever one is chosen (the
CLI, notebooks, sweep files, the chat panel, the servers): ``KIND`` or ``KIND:ARGUMENT``
(``ngram:3,2,1``, ``draft:smollm2-135m-instruct:int4``), ``none`` for plain decoding, or
``FIRST+SECOND`` (two chain proposers, the second drafting where the first offers too
little). Each kind is declared once, as a :class:`ProposerKind`: its name, how its
argument is written and checked, what it needs (nothing, the verifier, a draft model, a
named drafter), whether it drafts trees, and how it is built. Everything that lists,
checks or builds proposers reads this registry: :func:`make_proposer`,
:func:`check_proposer_spec`, the command-line help, the server's allow-list, the chat
panel's menu, the docs table and the tests. Registering a kind (:func:`register_proposer`,
from any module, the package's own kinds in :mod:`kakeya_lab.proposers.builtin`) makes it
available to all of them.

This module imports no tensor library: the CLI checks specs with it before anything loads.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kakeya_lab.errors import InputTypeError

Needs = Literal["nothing", "verifier", "draft model", "named drafter"]
NEEDS: tuple[str, ...] = get_args(Needs)
Builder = Callable[[str, "ProposerRequest"], Any]
ArgumentCheck = Callable[[str, str], None]


def no_argument(spec: str, argument: str) -> None:
    """The check of a kind that takes no argument."""
    if argument:
        raise ValueError(f"{spec!r} takes no argument: write it as {spec.partition(':')[0]}")


@dataclass(frozen=True)
class ProposerKind:
    """One kind of proposer, as its spec names it.

    ``name``: the spec's first part (letters, digits and ``-``); ``usage``: how a spec of
    this kind is written (``ngram[:SIZES]``); ``summary``: one line on what it drafts from;
    ``build(argument, request)``: the proposer for the text after ``name:`` (``""`` when
    there is none), or a ``"module:function"`` path to such a function, imported on first
    use (so listing kinds imports no model code); ``check(spec, argument)`` raises
    ``ValueError`` saying how to write a bad argument (it runs before anything loads);
    ``needs``: what the kind needs beyond the token history (``nothing``: model-free, so
    served and offered everywhere; ``verifier``: the verifier's own weights; ``draft
    model``: the model its argument names; ``named drafter``: a trained drafter of the
    store, named by its argument); ``tree``: it drafts draft trees; ``wraps``: its argument
    is a chain spec of its own (``tree:SPEC``); ``backends``: the backends it runs on (empty:
    all); ``example``: a spec of this kind that runs with the default model (default: the
    bare name), used by the docs, the chat panel and the tests.
    """

    name: str
    usage: str
    summary: str
    build: Builder | str
    check: ArgumentCheck = no_argument
    needs: Needs = "nothing"
    tree: bool = False
    wraps: bool = False
    backends: tuple[str, ...] = ()
    example: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InputTypeError(f"a proposer kind needs a name, got {self.name!r}")
        if not all(c.isalnum() or c == "-" for c in self.name) or self.name == "none":
            raise ValueError(
                f"bad proposer kind name {self.name!r}: use letters, digits and '-' (not 'none')"
            )
        if self.needs not in NEEDS:
            raise ValueError(f"needs must be one of {', '.join(NEEDS)}, got {self.needs!r}")
        if not (callable(self.build) or (isinstance(self.build, str) and ":" in self.build)):
            raise InputTypeError(
                f"build must be a function (argument, request) -> proposer or a "
                f"'module:function' path, got {self.build!r}"
            )
        if not self.example:
            object.__setattr__(self, "example", self.name)

    @property
    def model_free(self) -> bool:
        """Whether it drafts from token ids alone (served, offered on every backend)."""
        return self.needs == "nothing"

    def builder(self) -> Builder:
        """The build function (a ``"module:function"`` path is imported here, on first use)."""
        if callable(self.build):
            return self.build
        module, _, name = self.build.partition(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ProposerRequest:
    """What a kind's builder gets besides its argument: the verifier's ``model`` (what
    ``load_model`` returns, or its bare network), the sink-window ``config``, the
    verifier's ``tokenizer``, and the options some kinds read: ``draft_model`` (an already
    loaded draft model for ``draft:``; with ``drafters`` holding a LoRA drafter, its merged
    draft model), ``shared_replies`` (a
    :class:`~kakeya_lab.proposers.suffix.SharedReplies` for the suffix kinds),
    ``verifier_sha256`` (the verifier's weight sha256, which a named drafter must have been
    trained for), ``drafters`` (already loaded named drafters by name, e.g. the ones a
    server shares; a name not in it is loaded from the store), ``draft_linear`` (a draft
    model's kernel when its spec names none) and ``draft_window`` (a draft model's own
    cache window)."""

    model: Any
    config: Any
    tokenizer: Any = None
    draft_model: Any = None
    shared_replies: Any = None
    verifier_sha256: str | None = None
    draft_linear: str | None = None
    draft_window: int | None = None
    drafters: Mapping[str, Any] | None = None

    def build(self, spec: str) -> Any:
        """The proposer of another spec with this request (for kinds that wrap one)."""
        return make_proposer(spec, request=self)


_KINDS: dict[str, ProposerKind] = {}
_LOCK = threading.RLock()
_BUILTINS_LOADED = False


def _kinds() -> dict[str, ProposerKind]:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        with _LOCK:
            if not _BUILTINS_LOADED:
                _BUILTINS_LOADED = True
                importlib.import_module("kakeya_lab.proposers.builtin")
    return _KINDS


def register_proposer(kind: ProposerKind, *, replace: bool = False) -> ProposerKind:
    """Add ``kind`` to the registry (``replace=True`` to redefine a name); returns it.

    From then on its name works in every spec: ``make_proposer``, the command line,
    the chat panel and, for a model-free kind, the servers."""
    if not isinstance(kind, ProposerKind):
        raise InputTypeError(f"register a ProposerKind, got {type(kind).__name__}")
    kinds = _kinds()
    with _LOCK:
        if kind.name in kinds and not replace and kinds[kind.name] != kind:
            raise ValueError(
                f"proposer kind {kind.name!r} is already registered; pass replace=True "
                "to redefine it"
            )
        kinds[kind.name] = kind
    return kind


def unregister_proposer(name: str) -> None:
    """Remove the kind ``name`` (a KeyError when it is not registered)."""
    kinds = _kinds()
    with _LOCK:
        del kinds[name]


def proposer_kinds() -> tuple[ProposerKind, ...]:
    """Every registered kind, in registration order (the package's own first)."""
    return tuple(_kinds().values())


def proposer_kind(name: str) -> ProposerKind:
    """The kind registered as ``name``; ValueError listing the kinds when there is none."""
    kinds = _kinds()
    if name not in kinds:
        raise ValueError(f"unknown proposer {name!r}: {usage()}")
    return kinds[name]


def usage() -> str:
    """How a spec is written, from the registered kinds (for help texts and errors)."""
    return "use none, " + ", ".join(k.usage for k in proposer_kinds()) + " or FIRST+SECOND"


def _leaf(spec: str) -> tuple[ProposerKind, str]:
    name, _, argument = spec.partition(":")
    if name in _kinds():
        return _kinds()[name], argument
    raise ValueError(f"unknown proposer {spec!r}: {usage()}")


def _is_chain(spec: str) -> bool:
    name = spec.partition(":")[0]
    return spec not in ("", "none") and not (name in _kinds() and _kinds()[name].tree)


def check_proposer_spec(spec: str | None) -> list[tuple[str, str]]:
    """The ``(kind, argument)`` leaves of a well-formed proposer spec (``[]`` for ``none``,
    ``""`` or ``None``: plain decoding); raises ValueError, saying how to write it, for any
    other spec. ``tree:ngram`` is the leaf ``("ngram", "")``; ``suffix+draft:M`` two leaves.

    Models and named drafters are not looked up here: a caller does that for the leaves
    whose kind needs one (:attr:`ProposerKind.needs`)."""
    if spec is not None and not isinstance(spec, str):
        raise InputTypeError(
            f"proposer spec must be a string or None, got {type(spec).__name__} ({usage()})"
        )
    if spec in (None, "", "none"):
        return []
    assert spec is not None
    if "+" in spec:  # FIRST+SECOND: two chain proposers
        first, _, second = spec.partition("+")
        leaves = []
        for part in (first, second):
            if not _is_chain(part):
                raise ValueError(f"FIRST+SECOND combines two chain proposers, got {spec!r}")
            leaves += check_proposer_spec(part)
        return leaves
    kind, argument = _leaf(spec)
    if kind.wraps:
        if not _is_chain(argument) or "+" in argument:
            raise ValueError(f"{kind.usage} wraps one chain proposer, got {spec!r}")
        return check_proposer_spec(argument)
    kind.check(spec, argument)
    return [(kind.name, argument)]


def make_proposer(
    spec: str | None,
    model: Any = None,
    config: Any = None,
    tokenizer: Any = None,
    *,
    request: ProposerRequest | None = None,
    **options: Any,
) -> Any:
    """Build the proposer a spec names (``None`` for ``none``: plain decoding).

    ``model`` is the verifier (what ``load_model`` returns, or its bare network),
    ``config`` the sink-window cache config, ``tokenizer`` the verifier's; ``options`` are
    the other fields of :class:`ProposerRequest` (``draft_model``, ``shared_replies``,
    ``verifier_sha256``, ``draft_linear``, ``draft_window``), or pass a whole ``request``.
    The spec's grammar is checked before anything loads (:func:`check_proposer_spec`);
    the kinds and what each takes are listed by :func:`proposer_kinds` (the table of
    ``docs/extending.md``, :func:`kinds_table`)."""
    check_proposer_spec(spec)  # the grammar, before anything loads
    if spec in (None, "", "none"):
        return None
    assert spec is not None
    if request is None:
        request = ProposerRequest(model, config, tokenizer, **options)
    elif model is not None or config is not None or tokenizer is not None or options:
        raise TypeError("pass either a request or model, config, tokenizer and options")
    if "+" in spec:  # FIRST+SECOND: the second drafts when the first offers too little
        from kakeya_lab.proposers.fallback import FallbackProposer

        first, _, second = spec.partition("+")
        return FallbackProposer(request.build(first), request.build(second))
    kind, argument = _leaf(spec)
    if kind.backends and _backend_name(request.model) not in kind.backends:
        raise ValueError(
            f"{spec!r} runs on the {' or '.join(kind.backends)} backend only ({kind.summary}); "
            f"load the model with backend={kind.backends[0]!r}"
        )
    return kind.builder()(argument, request)


def _backend_name(model: Any) -> str:
    from kakeya_lab.backends import registry

    return registry.name_of(model)


def load_proposer_module(source: str) -> Any:
    """Import ``source`` (a Python file's path, or an importable module's name) for the
    proposer kinds it registers, and return the module; ValueError when it cannot be
    imported (a missing file, or the module's own error, named)."""
    import importlib.util
    import os

    if source.endswith(".py") or os.sep in source:
        path = os.path.abspath(os.path.expanduser(source))
        if not os.path.isfile(path):
            raise ValueError(f"no proposer module at {source!r} (a .py file or a module name)")
        name = "kakeya_lab_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {source!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ValueError(f"importing {source!r} failed: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(source)
    except Exception as exc:
        raise ValueError(f"importing {source!r} failed: {type(exc).__name__}: {exc}") from exc


def kinds_table() -> str:
    """The registered kinds as a Markdown table (spec, needs, drafts, what it drafts from):
    the table of ``docs/extending.md``, which a test keeps equal to this."""
    rows = ["| spec | needs | drafts | drafts from |", "|---|---|---|---|"]
    for kind in proposer_kinds():
        drafts = "a tree" if kind.tree else "a chain"
        rows.append(f"| `{kind.usage}` | {kind.needs} | {drafts} | {kind.summary} |")
    return "\n".join(rows) + "\n"
