"""The arms of a long run: ways of serving the same conversation, side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from kakeya_lab.backends.config import PositionMode, SinkWindowConfig
from kakeya_lab.bench.long_run.settings import ARM_NAMES, LongRunSettings
from kakeya_lab.proposers import check_proposer_spec, usage


@dataclass(frozen=True)
class Arm:
    """One way of serving the conversation. ``stateless``: a fresh cache every turn;
    ``proposer``: a :func:`~kakeya_lab.proposers.make_proposer` spec for speculative
    decoding with ``draft_length`` drafts (None: plain decoding)."""

    name: str
    config: SinkWindowConfig
    stateless: bool = False
    proposer: str | None = None
    draft_length: int = 4

    def to_dict(self) -> dict:
        out = {"name": self.name, "config": self.config.to_dict(), "stateless": self.stateless}
        if self.proposer is not None:  # plain arms keep the settings older checkpoints saved
            out.update(proposer=self.proposer, draft_length=self.draft_length)
        return out


def standard_arms(
    sink: int,
    window: int,
    positions: str = "global",
    names: Sequence[str] = ("sink_window", "full_cache", "reprefill"),
    *,
    proposer: str | None = None,
    draft_length: int = 4,
) -> dict[str, Arm]:
    """``sink_window`` (our runtime, bounded cache), ``full_cache`` (the same runtime, a
    cache that never evicts) and ``reprefill`` (stateless: the whole conversation is
    prefilled into a fresh cache every turn, as an HTTP chat endpoint does) and
    ``speculative`` (the ``sink_window`` runtime decoding speculatively with
    ``proposer``; greedy, so its replies equal ``sink_window``'s).

    Raises ValueError for an unknown, repeated or missing arm name or a bad cache size
    (before any model is needed)."""
    names = list(names)
    unknown = sorted(set(names) - set(ARM_NAMES))
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(ARM_NAMES)}")
    if not names:
        raise ValueError(f"no arms given; known: {', '.join(ARM_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm is named twice in {names}")
    full = SinkWindowConfig(sink=0, window=None)
    known = {
        "full_cache": Arm("full_cache", full),
        "reprefill": Arm("reprefill", full, stateless=True),
    }
    if {"sink_window", "speculative"} & set(names):
        # SinkWindowConfig checks ``positions`` at run time (a clear ValueError).
        bounded = SinkWindowConfig(
            sink=sink, window=window, positions=cast(PositionMode, positions)
        )
        if "sink_window" in names:
            known["sink_window"] = Arm("sink_window", bounded)
        if "speculative" in names:
            if not check_proposer_spec(proposer):
                raise ValueError(
                    f"the speculative arm needs a proposer, got {proposer!r} ({usage()})"
                )
            if (
                isinstance(draft_length, bool)
                or not isinstance(draft_length, int)
                or draft_length < 1
            ):
                raise ValueError(f"draft_length must be an integer >= 1, got {draft_length!r}")
            known["speculative"] = Arm(
                "speculative", bounded, proposer=proposer, draft_length=draft_length
            )
    if "speculative" not in names and proposer is not None:
        raise ValueError(
            "a proposer was given but no speculative arm: add 'speculative' to the arms"
        )
    return {n: known[n] for n in names}


def arms_for(settings: LongRunSettings) -> dict[str, Arm]:
    """The in-process arms ``settings`` asks for (:func:`standard_arms`)."""
    return standard_arms(
        settings.sink,
        settings.window,
        settings.positions,
        names=settings.arms,
        proposer=settings.proposer,
        draft_length=settings.draft_length,
    )
