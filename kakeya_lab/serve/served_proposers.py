"""The proposers a server accepts per request: every model-free kind of the registry, and
the draft models it loaded once at startup (``kakeya-lab serve --draft draft:MODEL[:KERNEL]``).

A draft model's weights are loaded once and shared by every session; each session that
uses it gets its own :class:`~kakeya_lab.proposers.draft_model.DraftModelProposer` (its
own draft cache), built by the registry's own builder
(:func:`~kakeya_lab.proposers.make_proposer` with the loaded ``draft_model``, as in-process
callers share one), lazily when the session first names it, and kept with the session until
it closes. The draft cache follows the session's history by itself: before each draft it
catches up with the tokens committed since (another proposer's turn, appends) or, if the
history is not an extension of what it holds, is rebuilt.

A request naming a proposer the server has not loaded (a draft model it did not load, a
kind that needs the verifier's weights or a named drafter) is refused before any state
changes, with what is loaded and how to load it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kakeya_lab.proposers import (
    ProposerKind,
    ProposerRequest,
    check_proposer_spec,
    make_proposer,
    proposer_kind,
    proposer_kinds,
)

DRAFT_FLAG = "--draft draft:MODEL[:KERNEL]"


@dataclass(frozen=True)
class LoadedDraft:
    """A draft model the server loaded: ``spec`` is its canonical ``draft:MODEL:KERNEL``."""

    spec: str
    name: str
    kernel: str
    model: Any  # what load_model returns


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
        """Load each ``draft:MODEL[:KERNEL]`` of ``specs`` once (ValueError, before any
        loads, for a spec of another kind) and check it drafts for this verifier (same
        tokenizer) by building one proposer."""
        from kakeya_lab.proposers.draft_model import load_draft_model

        served = cls(
            model, config, tokenizer, verifier_sha256=verifier_sha256, draft_window=draft_window
        )
        wanted = {served._canonical(check_draft_flag(spec)): spec for spec in specs}
        drafts = []
        for canonical in wanted:
            argument = canonical.partition(":")[2]
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

    def _canonical(self, argument: str) -> str:
        from kakeya_lab.proposers.draft_model import draft_model_choice

        name, kernel = draft_model_choice(argument, self.request)
        return f"draft:{name}:{kernel}"

    # ----------------------------------------------------------------- checking
    def model_free(self) -> list[ProposerKind]:
        """The registry's model-free kinds (served without loading anything)."""
        return [kind for kind in proposer_kinds() if kind.model_free]

    def loaded(self) -> list[str]:
        """The canonical specs of the loaded draft models."""
        return list(self.drafts)

    def _served(self) -> str:
        kinds = ", ".join(k.usage for k in self.model_free())
        drafts = ", ".join(self.drafts) or "no draft model"
        return f"none, the model-free kinds ({kinds}) and the draft models loaded ({drafts})"

    def resolve(self, spec: str | None) -> LoadedDraft | None:
        """The loaded draft model ``spec`` drafts with (None for a model-free spec);
        ValueError, naming what is served and how to load a draft model, for a spec this
        server cannot serve (the grammar's own message for a malformed one)."""
        leaves = check_proposer_spec(spec)
        used: list[LoadedDraft] = []
        for kind, argument in leaves:
            if proposer_kind(kind).model_free:
                continue
            if kind == "draft":
                draft = self.drafts.get(self._canonical(argument))
                if draft is not None:
                    used.append(draft)
                    continue
                raise ValueError(
                    f"proposer {spec!r}: the draft model {self._canonical(argument)} is not loaded "
                    f"on this server; it serves {self._served()}. Start the server with "
                    f"--draft {self._canonical(argument)} to serve it"
                )
            raise ValueError(
                f"proposer {spec!r} is not served here: {kind} needs a "
                f"{proposer_kind(kind).needs}, which a server does not load; this server "
                f"serves {self._served()}; load a draft model with {DRAFT_FLAG} at startup"
            )
        if len({d.spec for d in used}) > 1:
            raise ValueError(
                f"proposer {spec!r} names two draft models: a request drafts with one at a time"
            )
        return used[0] if used else None

    # ----------------------------------------------------------------- building
    def build(self, spec: str) -> Any:
        """A new proposer of ``spec`` (a loaded draft model's: its own draft cache over the
        shared weights); None for ``none``."""
        draft = self.resolve(spec)
        request = self.request
        if draft is not None:
            request = ProposerRequest(
                request.model,
                request.config,
                request.tokenizer,
                draft_model=draft.model,
                verifier_sha256=request.verifier_sha256,
                draft_window=request.draft_window,
            )
        return make_proposer(spec, request=request)

    def listing(self) -> list[dict]:
        """What ``GET /v1/proposers`` lists: the model-free kinds, then the loaded drafts."""
        rows = [
            {"id": k.name, "usage": k.usage, "summary": k.summary, "tree": k.tree, "loaded": False}
            for k in self.model_free()
        ]
        draft = proposer_kind("draft")
        rows += [
            {"id": d.spec, "usage": d.spec, "summary": draft.summary, "tree": False, "loaded": True}
            for d in self.drafts.values()
        ]
        return rows


def check_draft_flag(spec: str) -> str:
    """The ``MODEL[:KERNEL]`` of a ``--draft`` value; ValueError unless it is one well-formed
    ``draft:MODEL[:KERNEL]`` (checked before anything loads)."""
    leaves = check_proposer_spec(spec)
    if not (isinstance(spec, str) and spec.startswith("draft:") and len(leaves) == 1):
        raise ValueError(
            f"--draft takes one draft model, written draft:MODEL[:KERNEL] "
            f"(e.g. draft:smollm2-135m-instruct:int4), got {spec!r}; model-free proposers "
            "need no loading"
        )
    return leaves[0][1]
