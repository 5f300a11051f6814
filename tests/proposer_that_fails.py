"""A proposer kind whose code fails (``fails``), loaded into a real server with
``--proposer-module``: the way a user's buggy proposer raises inside the engine. Its
``bind`` (called when generation starts, before any token) raises ``RuntimeError``."""

from __future__ import annotations

from kakeya_lab.proposers import Draft, ProposerKind, register_proposer

MESSAGE = "this proposer fails on purpose"


class FailingProposer:
    name = "fails"

    def bind(self, verifier) -> None:
        raise RuntimeError(MESSAGE)

    def propose(self, context, draft_length, sampling=None, generator=None) -> Draft:
        raise RuntimeError(MESSAGE)

    def accept(self, n: int) -> None:
        return None

    def describe(self) -> dict:
        return {"name": self.name}


register_proposer(
    ProposerKind(
        name="fails",
        usage="fails",
        summary="raises RuntimeError (tests of engine errors)",
        build=lambda argument, request: FailingProposer(),
    ),
    replace=True,
)
