"""The settings of a proposer-alignment run (notebook 40), one frozen value validated once.

Capture (``train_conversations`` and ``dev_conversations`` per domain, ``capture_turns``
user turns each, replies of at most ``capture_max_new_tokens``), training (``drafters``
kinds, ``steps`` per kind, ``batch_size``, ``lr``, the shapes from ``draft_vocab_size``,
``context_len``, ``block_size``, ``block_width``, ``lora_base``), and the online evaluation
(``eval_conversations`` per domain and split, ``eval_turns``, ``eval_max_new_tokens``,
``eval_draft_length``, and the best drafter's ``draft_lengths`` curve). ``linear``: the
verifier's linear kernel (a full-precision one or ``"auto"``); ``plain_kernels``: the kernels
the evaluation also times plain decoding on, the fastest being every speedup's baseline
(:class:`~kakeya_lab.bench.speculative_settings.SpeculativeSettings`). ``train_conversations``
and ``capture_turns`` may be one value or a ``{domain: value}`` dict. The run folder:
:func:`~kakeya_lab.align.pipeline.write_alignment_results`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kakeya_lab.data import DOMAINS
from kakeya_lab.settings import Settings, SettingsError, check_int, check_kernels

KINDS = ("feature", "block", "lora")  # kakeya_lab.proposers.drafters.network.KINDS


@dataclass(frozen=True)
class AlignmentSettings(Settings):
    """One alignment run (see the module docstring for the fields)."""

    model: str = "smollm2-135m-instruct"
    domains: tuple[str, ...] = DOMAINS
    sink: int = 4
    window: int = 252
    train_conversations: int | dict[str, int] = 3
    dev_conversations: int = 1
    capture_turns: int | dict[str, int] = 1
    capture_max_new_tokens: int = 24
    drafters: tuple[str, ...] = KINDS
    steps: dict[str, int] = field(default_factory=lambda: {"feature": 60, "block": 60, "lora": 4})
    batch_size: int = 16
    lr: float = 2e-3
    draft_vocab_size: int = 4096
    context_len: int = 8
    block_size: int = 4
    block_width: int = 256
    lora_base: str = "early-exit:8"
    eval_conversations: int = 1
    eval_turns: int = 1
    eval_max_new_tokens: int = 24
    eval_draft_length: int = 4
    draft_lengths: tuple[int, ...] = (1, 2, 4)
    seed: int = 0
    linear: str = "aten"
    plain_kernels: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise :class:`~kakeya_lab.settings.SettingsError` for a setting that cannot work."""
        unknown = sorted(set(self.domains) - set(DOMAINS))
        if unknown or not self.domains:
            raise SettingsError(
                "domains", f"must name some of {', '.join(DOMAINS)}, got {list(self.domains)}"
            )
        unknown = sorted(set(self.drafters) - set(KINDS))
        if unknown or not self.drafters:
            raise SettingsError(
                "drafters", f"must name some of {', '.join(KINDS)}, got {list(self.drafters)}"
            )
        missing = [k for k in self.drafters if k not in self.steps]
        if missing:
            raise SettingsError("steps", f"has no step count for {missing}")
        for kind in self.drafters:
            check_int(f"steps[{kind!r}]", self.steps[kind], 1)
        for name in ("train_conversations", "capture_turns"):
            value = getattr(self, name)
            values = value if isinstance(value, dict) else {d: value for d in self.domains}
            for domain in self.domains:
                if domain not in values:
                    raise SettingsError(name, f"has no value for domain {domain!r}")
                check_int(f"{name}[{domain!r}]", values[domain], 1)
        check_int("sink", self.sink, 0)
        check_int("seed", self.seed, 0)
        for name in (
            "window", "dev_conversations", "capture_max_new_tokens", "batch_size",
            "draft_vocab_size", "context_len", "block_size", "block_width",
            "eval_conversations", "eval_turns", "eval_max_new_tokens", "eval_draft_length",
        ):  # fmt: skip
            check_int(name, getattr(self, name), 1)
        check_kernels(self.linear, self.plain_kernels)
        if not self.draft_lengths:
            raise SettingsError("draft_lengths", "must name at least one draft length")
        for n in self.draft_lengths:
            check_int("draft_lengths", n, 1)
        if (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, int | float)
            or not (math.isfinite(self.lr) and self.lr > 0)
        ):
            raise SettingsError("lr", f"must be a finite number > 0, got {self.lr!r}")

    def header_fields(self) -> dict[str, Any]:
        """What the run folder's header records beside ``settings``."""
        return {
            "train_conversations": self.train_conversations,
            "dev_conversations": self.dev_conversations,
            "steps": self.steps,
        }
