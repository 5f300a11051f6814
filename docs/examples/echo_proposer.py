"""A model-free proposer kept in a user's own file: ``echo[:WIDTH]`` drafts the tokens that
followed the previous occurrence of the history's last token (a one-token prompt lookup,
scanning at most ``WIDTH`` tokens back; default 256).

Import this module (or run it) and ``echo`` works wherever a proposer spec does:
``make_proposer("echo:64", ...)``, ``SessionStore.generate(..., proposer=...)``, the chat
panel's menu and, being model-free, the servers' allow-list.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kakeya_lab.proposers import Draft, ProposerKind, ProposerRequest, register_proposer


class EchoProposer:
    """Drafts what followed the last token's previous occurrence."""

    name = "echo"

    def __init__(self, width: int = 256):
        self.width = width

    def propose(self, context: Sequence[int], draft_length: int, sampling=None, generator=None):
        t0 = time.perf_counter()
        last, start = context[-1], max(0, len(context) - 1 - self.width)
        for i in range(len(context) - 2, start - 1, -1):
            if context[i] == last:
                tokens = list(context[i + 1 : i + 1 + draft_length])
                return Draft(tokens, None, time.perf_counter() - t0)
        return Draft([], None, time.perf_counter() - t0)

    def accept(self, n: int) -> None:
        return None  # no state to roll back: every draft is computed from the context

    def describe(self) -> dict:
        return {"name": self.name, "width": self.width}


def check_width(spec: str, argument: str) -> None:
    """Runs before anything loads: a bad argument says how to write it."""
    if argument and not (argument.isdigit() and int(argument) >= 1):
        raise ValueError(f"bad width in {spec!r}: write it like echo:64")


def build(argument: str, request: ProposerRequest) -> EchoProposer:
    return EchoProposer(int(argument) if argument else 256)


ECHO = register_proposer(
    ProposerKind(
        name="echo",
        usage="echo[:WIDTH]",
        summary="what followed the last token's previous occurrence",
        build=build,
        check=check_width,
    ),
    replace=True,  # importing the file twice (a notebook re-run) redefines it
)
