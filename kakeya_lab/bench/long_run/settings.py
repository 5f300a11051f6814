"""The settings of a long run (in-process arms), one frozen value validated once.

The CLI (``kakeya-lab long-run``), notebook 20, sweeps and the checkpoint's strict resume
all use :class:`LongRunSettings`; :func:`~kakeya_lab.bench.long_run.run_long` takes it
instead of a long list of keyword arguments. Torch-free: the CLI builds it (and so checks
every setting) before a model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kakeya_lab.bench.gates import check_prefill_gate
from kakeya_lab.linear_kernels import KERNELS
from kakeya_lab.proposers.registry import check_proposer_spec, usage
from kakeya_lab.settings import Settings, SettingsError, check_int, check_positive

if TYPE_CHECKING:
    from kakeya_lab.bench.long_run.probe import FactProbe

ARM_NAMES = ("sink_window", "full_cache", "reprefill", "speculative")
DEFAULT_ARMS = ("sink_window", "full_cache", "reprefill")
POSITIONS = ("global", "rolling")
BACKENDS = ("torch", "mlx")
SERVED_ARMS = ("grpc_session", "http_reuse", "http_stateless")
CHECKPOINT = "checkpoint.json"
# What a long run writes in its folder (a fresh start removes them).
OUTPUTS = (CHECKPOINT, "turns.csv", "served_turns.csv", "metrics.json")


@dataclass(frozen=True)
class LongRunSettings(Settings):
    """Everything a long run is asked to do.

    ``model``/``backend``/``linear``: what :func:`kakeya_lab.models.load_model` loads (the
    run's header records the loaded model's own identity; ``linear``, the torch model's
    linear kernel, is part of the run's identity: a resume must run the same). ``arms``: names from
    :data:`ARM_NAMES` (in-process); ``served_arms``: names from :data:`SERVED_ARMS`, driven
    through a running ``kakeya-lab serve`` (at least one arm in all); ``sink``/``window``/``positions``: the bounded arms' cache;
    ``proposer``/``draft_length``: the ``speculative`` arm's
    (:func:`~kakeya_lab.bench.long_run.arms.arms_for` builds them). ``turns``: user turns in the
    script (cycled when ``duration_s`` asks for more); ``probe_every``: a recall probe
    every that many turns (0: none). ``checkpoint_every`` turns and ``report_every_s``
    seconds (None: by turns only): when a run with an output folder checkpoints and
    reports. ``reprefill_cap_s``: the stateless arm stops after a slower turn (None: never).
    ``turn_spacing_s``: round ``i`` starts ``i * turn_spacing_s`` after the start (None:
    back to back). ``turns_per_bucket`` / ``seconds_per_bucket``: the summary's buckets.
    ``served_proposer``: the proposer spec every served arm's requests name (None: plain
    decoding; the server decides what it serves, with ``draft_length`` drafts).
    ``max_errors``: a served run aborts once more turns than this failed (a failing turn
    is recorded and counted, not fatal). ``prefill_tolerance`` / ``prefill_direction``:
    the reference prefill gate's thresholds
    (:func:`~kakeya_lab.bench.aggregate.prefill_bounded`; the tolerance also serves
    :func:`~kakeya_lab.bench.aggregate.prefill_flat_vs_history`).
    """

    model: str = "smollm2-135m-instruct"
    backend: str = "torch"
    linear: str = "aten"
    arms: tuple[str, ...] = DEFAULT_ARMS
    served_arms: tuple[str, ...] = ()
    sink: int = 4
    window: int = 1020
    positions: str = "global"
    proposer: str | None = None
    draft_length: int = 4
    turns: int = 100
    max_new_tokens: int = 32
    duration_s: float | None = None
    probe_every: int = 25
    checkpoint_every: int = 10
    reprefill_cap_s: float | None = 30.0
    turns_per_bucket: int = 50
    seconds_per_bucket: float = 600.0
    turn_spacing_s: float | None = None
    report_every_s: float | None = 600.0
    served_proposer: str | None = None
    max_errors: int = 10
    prefill_tolerance: float = 0.10
    prefill_direction: str = "increase"

    def validate(self) -> None:
        """Raise :class:`~kakeya_lab.settings.SettingsError` for any setting that cannot work."""
        if not isinstance(self.model, str) or not self.model:
            raise SettingsError("model", f"must name a model, got {self.model!r}")
        if self.backend not in BACKENDS:
            raise SettingsError(
                "backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.linear not in KERNELS:
            raise SettingsError(
                "linear", f"must be one of {', '.join(KERNELS)}, got {self.linear!r}"
            )
        if self.backend != "torch" and self.linear != "aten":
            raise SettingsError(
                "linear",
                f"{self.linear} is a torch kernel; the {self.backend} backend has its own",
            )
        names = list(self.arms)
        _check_names("arms", names, ARM_NAMES)
        _check_names("served_arms", list(self.served_arms), SERVED_ARMS)
        if not names and not self.served_arms:
            raise SettingsError("arms", f"no arms given; known: {', '.join(ARM_NAMES)}")
        check_int("sink", self.sink, 0)
        check_int("window", self.window, 1)
        if self.positions not in POSITIONS:
            raise SettingsError(
                "positions", f"must be 'global' or 'rolling', got {self.positions!r}"
            )
        if "speculative" in names:
            try:
                leaves = check_proposer_spec(self.proposer)
            except ValueError as exc:
                raise SettingsError("proposer", str(exc)) from exc
            if not leaves:
                raise SettingsError(
                    "proposer", f"the speculative arm needs one, got {self.proposer!r} ({usage()})"
                )
        elif self.proposer is not None:
            raise SettingsError(
                "proposer", "is for the speculative arm: add 'speculative' to the arms"
            )
        for name in ("draft_length", "turns", "max_new_tokens", "checkpoint_every"):
            check_int(name, getattr(self, name), 1)
        check_int("turns_per_bucket", self.turns_per_bucket, 1)
        check_int("probe_every", self.probe_every, 0)
        for name in ("duration_s", "reprefill_cap_s", "turn_spacing_s", "report_every_s"):
            check_positive(name, getattr(self, name))
        check_positive("seconds_per_bucket", self.seconds_per_bucket, optional=False)
        if self.served_proposer is not None:
            if not self.served_arms:
                raise SettingsError(
                    "served_proposer", "is for the served arms: give served_arms (--endpoint)"
                )
            try:
                check_proposer_spec(self.served_proposer)
            except ValueError as exc:
                raise SettingsError("served_proposer", str(exc)) from exc
        check_int("max_errors", self.max_errors, 0)
        try:
            check_prefill_gate(self.prefill_tolerance, self.prefill_direction)
        except ValueError as exc:
            field = "prefill_direction" if "direction" in str(exc) else "prefill_tolerance"
            raise SettingsError(field, str(exc).split(" ", 1)[1]) from exc

    def probe(self) -> FactProbe | None:
        """The recall probe (None when ``probe_every`` is 0)."""
        from kakeya_lab.bench.long_run.probe import FactProbe

        return FactProbe(every=self.probe_every) if self.probe_every else None

    def user_turns(self) -> list[str]:
        """The standard turn script: ``turns`` chained chit-chat user turns (dev split)."""
        from kakeya_lab.data import chained_user_turns, chitchat_conversations

        return chained_user_turns(chitchat_conversations("dev"), self.turns)


def _check_names(field: str, names: list[str], known: tuple[str, ...]) -> None:
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SettingsError(field, f"unknown arm(s) {unknown}; known: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise SettingsError(field, f"an arm is named twice in {names}")
