"""Next-token sampling shared by plain decoding, speculative decoding and the proposers.

:class:`SamplingConfig` is the one place the sampling knobs live (temperature, top-k,
top-p, seed). It is validated once; ``greedy`` says whether tokens are argmax choices;
:meth:`SamplingConfig.choose` picks the next token and :meth:`SamplingConfig.probs` gives
the filtered distribution sampling draws from (what rejection sampling compares).
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Below this a temperature is greedy in all but name, and logits divided by it overflow
# float32 (1e-45 turned every logit into inf, then NaN, mid-stream): 0 means greedy.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick tokens. ``temperature == 0`` is greedy (top-k/top-p/seed unused).

    ``seed=None`` draws a fresh seed per generation (not reproducible).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        from kakeya_lab import inputs

        temperature = inputs.number(self.temperature, "temperature", minimum=0.0)
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                f"{temperature:g} (smaller ones overflow the logits; use 0 for greedy)"
            )
        object.__setattr__(self, "temperature", temperature)
        if self.top_k is not None:
            object.__setattr__(self, "top_k", inputs.count(self.top_k, "top_k", minimum=1))
        if self.top_p is not None:
            top_p = inputs.number(self.top_p, "top_p", minimum=0.0, strict=True)
            if top_p > 1.0:
                raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}")
            object.__setattr__(self, "top_p", top_p)
        if self.seed is not None:
            object.__setattr__(
                self, "seed", inputs.count(self.seed, "seed", minimum=0, maximum=2**63 - 1)
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator | None:
        """A CPU generator seeded from ``seed`` (a random seed if None); None when greedy."""
        if self.greedy:
            return None
        import torch

        generator = torch.Generator(device="cpu")
        generator.manual_seed(self.seed if self.seed is not None else secrets.randbits(63))
        return generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: temperature, then top-k, then top-p.

        Greedy configs give the one-hot distribution of the argmax.
        """
        import torch

        if self.greedy:
            probs = torch.zeros(logits.shape[-1], dtype=torch.float32)
            probs[int(torch.argmax(logits))] = 1.0
            return probs
        return sampling_probs(
            logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> int:
        """The next token from ``logits [vocab]``: the argmax if greedy, else a sample."""
        import torch

        if self.greedy:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=generator))

    def to_dict(self) -> dict:
        return asdict(self)


GREEDY = SamplingConfig()


def sampling_probs(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) over ``logits [vocab]``; ``temperature > 0``."""
    import torch

    scores = logits.float() / temperature
    if top_k is not None and 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop = cumulative - sorted_probs > top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
