"""A proposer kind whose argument only its builder checks (``picky:WORD``), loaded into a
real server with ``--proposer-module``: the way a user's kind refuses a bad argument when it
is built, not in a ``check``. ``picky:ok`` builds an n-gram proposer; any other word is a
ValueError from the builder."""

from __future__ import annotations

from kakeya_lab.proposers import ProposerKind, make_proposer, register_proposer

MESSAGE = "picky takes only the argument 'ok'"


def _build(argument: str, request):
    if argument != "ok":
        raise ValueError(f"{MESSAGE}, got {argument!r}")
    return make_proposer("ngram", request=request)


register_proposer(
    ProposerKind(
        name="picky",
        usage="picky:WORD",
        summary="an n-gram proposer whose builder refuses any word but 'ok' (tests)",
        build=_build,
        check=lambda spec, argument: None,
        example="picky:ok",
    ),
    replace=True,
)
