"""The proposers a server accepts per request: every model-free kind of the registry, and
the draft models and named drafters it loaded once at startup (``kakeya-lab serve --draft
draft:MODEL[:KERNEL]`` or ``--draft drafter:NAME``).

A draft model's or a named drafter's weights are loaded once and shared by every session;
each session that uses it gets its own proposer, built by the registry's own builder
(:func:`~kakeya_lab.proposers.make_proposer` with the loaded ``draft_model`` or
``drafters``, as in-process callers share them), lazily when the session first names it,
and kept with the session until it closes:

* a draft model's :class:`~kakeya_lab.proposers.draft_model.DraftModelProposer` holds the
  session's own draft cache, which follows the session's history by itself: before each
  draft it catches up with the tokens committed since (another proposer's turn, appends)
  or, if the history is not an extension of what it holds, is rebuilt;
* a named drafter's proposer (``drafter:NAME``, and ``drafter-tree:NAME`` for a feature
  drafter) reads the hidden states its session's verifier records (the session's own
  trace); a LoRA drafter drafts as a draft model, with its own cache.

A request naming a proposer the server has not loaded (a draft model or drafter it did not
load, a kind that needs the verifier's own weights) is refused before any state changes,
with what is loaded and how to load it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from kakeya_lab.proposers import (
    ProposerKind,
    ProposerRequest,
    check_proposer_spec,
    make_proposer,
    proposer_kind,
    proposer_kinds,
)

if TYPE_CHECKING:
    from kakeya_lab.proposers.drafters.lora import LoraDrafter

DRAFT_FLAG = "--draft draft:MODEL[:KERNEL] or --draft drafter:NAME"


# the kinds a server loads with --draft, and the request kinds each one serves
LOADED_KINDS = {"draft": ("draft",), "drafter": ("drafter", "drafter-tree")}


@dataclass(frozen=True)
class LoadedDraft:
    """A draft model or named drafter the server loaded: ``spec`` is its canonical
    ``draft:MODEL:KERNEL`` or ``drafter:NAME``; ``kernel`` is empty for a drafter (it runs
    the verifier's)."""

    spec: str
    name: str
    kernel: str
    model: Any  # what load_model returns, or the loaded drafter network
    merged: Any = None  # a LoRA drafter's draft model (its adapters merged)

    @property
    def kind(self) -> str:
        return self.spec.partition(":")[0]


def _draft_caches(proposer: Any) -> Iterator[Any]:
    """The draft-model proposers inside ``proposer`` (FIRST+SECOND and tree:SPEC unwrapped)."""
    from kakeya_lab.proposers.draft_model import DraftModelProposer

    if isinstance(proposer, DraftModelProposer):
        yield proposer
        return
    for attr in ("first", "second", "proposer"):
        inner = getattr(proposer, attr, None)
        if inner is not None:
            yield from _draft_caches(inner)


def draft_cache_bytes(proposer: Any) -> int:
    """Bytes of K and V held by the draft caches inside ``proposer`` (0 for none)."""
    return sum(p.verifier.kv_live_bytes for p in _draft_caches(proposer))


def release_draft_caches(proposer: Any) -> None:
    """Free the draft caches inside ``proposer`` (the shared weights stay loaded)."""
    for p in _draft_caches(proposer):
        p.verifier.release()


class ServedProposers:
    """What requests may name, and the per-session proposers of the loaded draft models."""

    def __init__(
        self,
        model: Any,
        config: Any,
        tokenizer: Any,
        *,
        verifier_sha256: str | None = None,
        drafts: Sequence[LoadedDraft] = (),
        draft_window: int | None = None,
    ):
        self.request = ProposerRequest(
            model, config, tokenizer, verifier_sha256=verifier_sha256, draft_window=draft_window
        )
        self.drafts = {d.spec: d for d in drafts}

    @classmethod
    def load(
        cls,
        specs: Sequence[str],
        model: Any,
        config: Any,
        tokenizer: Any,
        *,
        verifier_sha256: str | None = None,
        draft_window: int | None = None,
    ) -> ServedProposers:
        """Load each ``draft:MODEL[:KERNEL]`` and ``drafter:NAME`` of ``specs`` once
        (ValueError, before any loads, for a spec of another kind) and check it drafts for
        this verifier (same tokenizer; a drafter trained for these weights) by building one
        proposer."""
        from kakeya_lab.proposers.draft_model import load_draft_model
        from kakeya_lab.proposers.drafters.named import load_named_drafter

        served = cls(
            model, config, tokenizer, verifier_sha256=verifier_sha256, draft_window=draft_window
        )
        wanted = {served._canonical(*check_draft_flag(spec)): spec for spec in specs}
        drafts = []
        for canonical in wanted:
            kind, _, argument = canonical.partition(":")
            if kind == "drafter":
                try:
                    drafter = load_named_drafter(argument, model, verifier_sha256)
                except (OSError, ValueError) as exc:  # not found, another verifier, damaged
                    raise ValueError(f"--draft {wanted[canonical]}: {exc}") from exc
                # a LoRA drafter drafts as a draft model: its adapters merged once, shared
                merged = None
                if drafter.config.kind == "lora":
                    merged = cast("LoraDrafter", drafter).draft_model()
                drafts.append(LoadedDraft(canonical, argument, "", drafter, merged))
                continue
            name, _, kernel = argument.rpartition(":")
            loaded = load_draft_model(argument, served.request)
            drafts.append(LoadedDraft(canonical, name, kernel, loaded))
        served.drafts = {d.spec: d for d in drafts}
        for draft in drafts:  # a tokenizer mismatch is refused here, at startup
            try:
                release_draft_caches(served.build(draft.spec))
            except ValueError as exc:
                raise ValueError(f"--draft {wanted[draft.spec]}: {exc}") from exc
        return served

    def _canonical(self, kind: str, argument: str) -> str:
        """The spec a loaded ``kind:argument`` is known by (``drafter-tree:NAME`` drafts
        with the loaded ``drafter:NAME``)."""
        if kind != "draft":
            return f"drafter:{argument}"
        from kakeya_lab.proposers.draft_model import draft_model_choice

        name, kernel = draft_model_choice(argument, self.request)
        return f"draft:{name}:{kernel}"

    # ----------------------------------------------------------------- checking
    def model_free(self) -> list[ProposerKind]:
        """The registry's model-free kinds (served without loading anything)."""
        return [kind for kind in proposer_kinds() if kind.model_free]

    def loaded(self) -> list[str]:
        """The canonical specs of the loaded draft models and drafters."""
        return list(self.drafts)

    def _served(self) -> str:
        kinds = ", ".join(k.usage for k in self.model_free())
        drafts = ", ".join(self.drafts) or "none"
        return f"none, the model-free kinds ({kinds}) and the drafts loaded ({drafts})"

    def resolve(self, spec: str | None) -> LoadedDraft | None:
        """The loaded draft model or drafter ``spec`` drafts with (None for a model-free
        spec); ValueError, naming what is served and how to load it, for a spec this server
        cannot serve (the grammar's own message for a malformed one)."""
        leaves = check_proposer_spec(spec)
        used: list[LoadedDraft] = []
        for kind, argument in leaves:
            if proposer_kind(kind).model_free:
                continue
            if any(kind in kinds for kinds in LOADED_KINDS.values()):
                canonical = self._canonical(kind, argument)
                draft = self.drafts.get(canonical)
                if draft is not None:
                    if kind == "drafter-tree":
                        from kakeya_lab.proposers.drafters.proposer import check_tree_drafter

                        check_tree_drafter(argument, draft.model)
                    used.append(draft)
                    continue
                what = "draft model" if kind == "draft" else "named drafter"
                raise ValueError(
                    f"proposer {spec!r}: the {what} {canonical} is not loaded on this server; "
                    f"it serves {self._served()}. Start the server with --draft {canonical} "
                    "to serve it"
                )
            raise ValueError(
                f"proposer {spec!r} is not served here: {kind} needs a "
                f"{proposer_kind(kind).needs}, which a server does not load; this server "
                f"serves {self._served()}; load a draft model or a named drafter with {DRAFT_FLAG} at "
                "startup"
            )
        if len({d.spec for d in used}) > 1:
            raise ValueError(
                f"proposer {spec!r} names two loaded drafts: a request drafts with one at a time"
            )
        return used[0] if used else None

    # ----------------------------------------------------------------- building
    def build(self, spec: str) -> Any:
        """A new proposer of ``spec`` (a loaded draft model's or drafter's: its own draft
        cache or trace over the shared weights); None for ``none``."""
        draft = self.resolve(spec)
        request = self.request
        if draft is not None:
            shared = (
                {"draft_model": draft.model}
                if draft.kind == "draft"
                else {"drafters": {draft.name: draft.model}, "draft_model": draft.merged}
            )
            request = replace(request, **shared)
        return make_proposer(spec, request=request)

    def listing(self) -> list[dict]:
        """What ``GET /v1/proposers`` lists: the model-free kinds, then the loaded drafts."""
        rows = [
            {"id": k.name, "usage": k.usage, "summary": k.summary, "tree": k.tree, "loaded": False}
            for k in self.model_free()
        ]
        for d in self.drafts.values():
            for kind in LOADED_KINDS[d.kind]:
                if kind == "drafter-tree" and d.model.config.kind != "feature":
                    continue  # only a feature drafter drafts trees
                spec = d.spec if kind == d.kind else f"{kind}:{d.name}"
                tree = proposer_kind(kind).tree
                summary = proposer_kind(kind).summary
                rows.append(
                    {"id": spec, "usage": spec, "summary": summary, "tree": tree, "loaded": True}
                )
        return rows


def check_draft_flag(spec: str) -> tuple[str, str]:
    """The kind (``draft`` or ``drafter``) and argument of a ``--draft`` value; ValueError
    unless it is one well-formed ``draft:MODEL[:KERNEL]`` or ``drafter:NAME`` (checked
    before anything loads)."""
    leaves = check_proposer_spec(spec)
    if not (len(leaves) == 1 and leaves[0][0] in LOADED_KINDS and spec == ":".join(leaves[0])):
        raise ValueError(
            f"--draft takes one draft model, written draft:MODEL[:KERNEL] "
            f"(e.g. draft:smollm2-135m-instruct:int4), or one named drafter, written "
            f"drafter:NAME (it serves drafter-tree:NAME too), got {spec!r}; model-free "
            "proposers need no loading"
        )
    return leaves[0]
