"""The settings of a speculative-decoding benchmark run, one frozen value validated once.

:func:`~kakeya_lab.bench.speculative.run_speculative` takes :class:`SpeculativeSettings`
(the cache, draft lengths, generation and cost-probe settings) beside the proposer
factories and conversations it runs; notebook 30 builds the same value from its parameters
and saves its run folder with :func:`~kakeya_lab.bench.speculative_report.save_speculative`.
Torch-free (the cache config is built on demand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kakeya_lab.linear_kernels import FULL_PRECISION
from kakeya_lab.settings import Settings, SettingsError, check_int, check_kernels

if TYPE_CHECKING:
    from kakeya_lab.backends.config import SinkWindowConfig
    from kakeya_lab.data import Conversation

POSITIONS = ("global", "rolling")


@dataclass(frozen=True)
class SpeculativeSettings(Settings):
    """One speculative-decoding run.

    ``model``/``backend``/``dtype``: what the run loads; ``proposers``: the proposer specs
    it builds (:func:`~kakeya_lab.proposers.make_proposer`; a ``SPEC@K`` runs at ``K``
    only), each at every one of ``draft_lengths``. ``prompt_set``/``conversations``/
    ``turns``: the held-out conversations and user turns per conversation. ``sink``/
    ``window``/``positions``: the cache of every arm (``window`` None: one that never evicts). ``temperature`` > 0 samples (seeded
    per turn from ``seed``). ``measure_cost``: time the verifier's block cost before and
    after the arms (``cost_repeats`` times per size); ``cost_aware`` and ``pad_blocks``
    (both need it) add the ``@costK`` and ``@padK`` arms. ``plain_kernels``: full-precision
    linear kernels plain decoding is also timed on, side by side with the arms (torch); every
    speedup is then against the fastest plain decoding of the run, whichever kernel that was
    (``run.plain_kernel``). ``linear``: the kernel the torch model is loaded with, so the one
    every arm runs (:func:`~kakeya_lab.models.load_model`; the MLX backend runs its own
    kernels and loads with ``aten``, :meth:`model_linear`).
    """

    model: str = "smollm2-135m-instruct"
    backend: str = "torch"
    dtype: str = "float32"
    proposers: tuple[str, ...] = ()
    draft_lengths: tuple[int, ...] = (4,)
    prompt_set: str = "chitchat-dev"
    conversations: int = 2
    turns: int = 4
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    sink: int = 4
    window: int | None = 252
    positions: str = "global"
    linear: str = "aten"
    measure_cost: bool = True
    cost_repeats: int = 5
    cost_aware: bool = False
    pad_blocks: bool = False
    plain_kernels: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise :class:`~kakeya_lab.settings.SettingsError` for a setting that cannot work."""
        check_kernels(self.linear, self.plain_kernels)
        for n in self.draft_lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise SettingsError(
                    "draft_lengths", f"must be >= 1, got {list(self.draft_lengths)}"
                )
        for spec in self.proposers:
            if not isinstance(spec, str) or not spec:
                raise SettingsError("proposers", f"must be proposer specs, got {spec!r}")
        for name in ("conversations", "turns", "max_new_tokens", "cost_repeats"):
            check_int(name, getattr(self, name), 1)
        if self.window is not None:
            check_int("window", self.window, 1)
        check_int("sink", self.sink, 0)
        check_int("seed", self.seed, 0)
        if self.positions not in POSITIONS:
            raise SettingsError(
                "positions", f"must be 'global' or 'rolling', got {self.positions!r}"
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise SettingsError("temperature", f"must be a finite number >= 0, got {t!r}")
        if (self.cost_aware or self.pad_blocks) and not self.measure_cost:
            raise SettingsError(
                "measure_cost",
                "is needed: cost_aware and pad_blocks arms plan with the measured block cost",
            )

    def model_linear(self) -> str:
        """The ``linear`` to load the model with: ``linear`` on torch, ``aten`` (none of
        torch's kernels) on another backend."""
        return self.linear if self.backend == "torch" else "aten"

    @classmethod
    def for_cache(cls, config: SinkWindowConfig, **fields: object) -> SpeculativeSettings:
        """Settings whose cache is ``config`` (``fields``: the others)."""
        return cls(
            sink=config.sink,
            window=config.window,
            positions=config.positions,
            **fields,  # type: ignore[arg-type]
        )

    def cache(self) -> SinkWindowConfig:
        """The sink-window cache of every arm."""
        from kakeya_lab.backends.config import SinkWindowConfig

        return SinkWindowConfig(sink=self.sink, window=self.window, positions=self.positions)  # type: ignore[arg-type]

    def conversation_list(self) -> list[Conversation]:
        """``conversations`` held-out conversations of ``prompt_set`` with at least ``turns``
        user turns."""
        from kakeya_lab.data import prompt_set_conversations

        return prompt_set_conversations(
            self.prompt_set, limit=self.conversations, min_turns=2 * self.turns
        )


@dataclass(frozen=True)
class SpecTableSettings(Settings):
    """The Spec-Bench-style table: every arm on every prompt set.

    ``arms``: ``SPEC@K`` keys (one method, one draft length or node budget); ``prompt_sets``:
    held-out sets (``code-dev``, ...), one run per set; ``conversations`` per set with
    ``turns`` user turns each. ``linear``: the verifier's linear kernel; ``assisted_draft``
    (a model name): also time transformers' assisted generation with it, loaded with
    ``draft_dtype``/``draft_linear`` (None: the verifier's); ``draft_window``: a draft
    model's own cache window (None: ``window``). ``cost_aware``/``pad_blocks``: the
    ``@costK``/``@padK`` arms (:class:`SpeculativeSettings`). ``plain_kernels``: the kernels
    plain decoding is timed on; speedups are against the fastest (torch; ``()``: only
    ``linear``).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    linear: str = "aten"
    arms: tuple[str, ...] = ("ngram@4", "suffix@4", "suffix-tree@4")
    prompt_sets: tuple[str, ...] = ("code-dev", "prose-dev", "chitchat-dev")
    conversations: int = 4
    turns: int = 2
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    sink: int = 4
    window: int = 252
    assisted_draft: str | None = None
    draft_dtype: str | None = None
    draft_linear: str | None = None
    draft_window: int | None = None
    cost_aware: bool = False
    pad_blocks: bool = False
    plain_kernels: tuple[str, ...] = FULL_PRECISION

    def validate(self) -> None:
        """Raise :class:`~kakeya_lab.settings.SettingsError` for a setting that cannot work."""
        if not self.arms or not self.prompt_sets:
            raise SettingsError("arms", "and prompt_sets: name at least one of each")
        for arm in self.arms:
            base, at, k = arm.rpartition("@")
            if not at:
                raise SettingsError(
                    "arms", f"arm {arm!r} needs its draft length: write it like ngram@8"
                )
            if not (base and k.isdigit() and int(k) >= 1):
                raise SettingsError("arms", f"bad arm {arm!r}: write a draft length like ngram@8")
        if self.draft_window is not None:
            check_int("draft_window", self.draft_window, 1)
        self.speculative(self.prompt_sets[0])  # the per-set settings are valid too

    def speculative(self, prompt_set: str) -> SpeculativeSettings:
        """The settings of the run on one prompt set (each arm at its own ``K``)."""
        return SpeculativeSettings(
            model=self.model,
            dtype=self.dtype,
            linear=self.linear,
            proposers=self.arms,
            draft_lengths=(),
            prompt_set=prompt_set,
            conversations=self.conversations,
            turns=self.turns,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            sink=self.sink,
            window=self.window,
            cost_aware=self.cost_aware,
            pad_blocks=self.pad_blocks,
            plain_kernels=self.plain_kernels,
        )
