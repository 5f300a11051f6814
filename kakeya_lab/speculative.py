"""Speculative decoding over the sink-window verifier (DESIGN.md "Speculative decoding").

One verifier forward per step scores ``[x, d1..dk]``: ``x`` the last emitted token (not
yet in the cache) and ``d`` the proposer's draft. Row ``i`` of the block's logits predicts
the token after ``block[:i+1]``, so it checks ``d[i]``.

* Greedy: accept drafts while they equal the verifier's argmax, then emit the verifier's
  own token. The verifier gives each block position the oracle's context, so the stream is
  identical to plain greedy decoding with the same cache, eviction included.
* Sampling: accept ``d`` with probability ``min(1, p(d)/q(d))``; on rejection draw from
  the normalised ``max(0, p - q)`` and stop; if every draft is accepted draw a bonus token
  from ``p``. This preserves the verifier's distribution (Leviathan et al. 2023).
  Deterministic drafts (``q`` one-hot) are the special case ``q(d) = 1``.

When a stream ends, every emitted token is committed and ``state.next_logits`` holds the
logits after the last one, exactly as after plain decoding (:func:`plain_decode`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kakeya_lab.proposers import Draft, Proposer
from kakeya_lab.sampling import sample_token, sampling_probs
from kakeya_lab.verifier import Verifier


@dataclass(frozen=True)
class SpeculativeStep:
    """One verifier forward: drafts ``proposed``, ``accepted`` of them, ``emitted`` tokens."""

    k: int
    proposed: int
    accepted: int
    emitted: int
    proposer_s: float
    verifier_s: float


@dataclass
class DecodeState:
    """Decoder state shared with the caller: the logits after the committed history, the
    emitted token not yet in the cache (if any), and what happened."""

    next_logits: torch.Tensor
    pending_token: int | None = None
    stop_reason: str = "max_tokens"
    emitted: int = 0
    verifier_forwards: int = 0
    verifier_s: float = 0.0
    steps: list[SpeculativeStep] = field(default_factory=list)


def settle(verifier: Verifier, state: DecodeState) -> None:
    """Commit an emitted-but-uncommitted token (after an abandoned or finished stream)."""
    if verifier.pending_len:
        verifier.rollback()
    if state.pending_token is not None:
        t0 = time.perf_counter()
        state.next_logits = verifier.append([state.pending_token])
        state.verifier_s += time.perf_counter() - t0
        state.verifier_forwards += 1
        state.pending_token = None


def plain_decode(
    verifier: Verifier,
    state: DecodeState,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_token_ids: Sequence[int] = (),
) -> Iterator[int]:
    """Plain decoding: one verifier forward per token (tau = 1). Each yielded token is
    already committed, and ``state.next_logits`` follows it."""
    stops = frozenset(stop_token_ids)
    for _ in range(max_new_tokens):
        token = sample_token(
            state.next_logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        t0 = time.perf_counter()
        state.next_logits = verifier.append([token])
        state.verifier_s += time.perf_counter() - t0
        state.verifier_forwards += 1
        state.emitted += 1
        yield token
        if token in stops:
            state.stop_reason = "stop"
            return


def accept_greedy(rows: torch.Tensor, draft: Sequence[int]) -> tuple[int, int]:
    """Accepted prefix length and the verifier's next token (greedy)."""
    targets = torch.argmax(rows, dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n, int(targets[n])


def accept_sampled(
    rows: torch.Tensor,
    draft: Draft,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection sampling: accepted prefix length and the next token (residual or bonus)."""
    tokens = draft.tokens
    for i, d in enumerate(tokens):
        p = sampling_probs(rows[i], temperature=temperature, top_k=top_k, top_p=top_p)
        if draft.probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0
        else:
            q = draft.probs[i].to(p)
        u = float(torch.rand((), generator=generator))
        if q[d] > 0 and u < min(1.0, float(p[d] / q[d])):
            continue
        residual = torch.clamp(p - q, min=0.0)
        total = residual.sum()
        if total <= 0:  # p == q: the rejection had probability 0; sample p
            residual, total = p, p.sum()
        return i, int(torch.multinomial(residual / total, 1, generator=generator))
    p = sampling_probs(rows[len(tokens)], temperature=temperature, top_k=top_k, top_p=top_p)
    return len(tokens), int(torch.multinomial(p, 1, generator=generator))


class AdaptiveK:
    """Grow ``k`` by one after a fully accepted draft, shrink it after a draft that lost
    more than half; bounded to ``[1, k_max]``."""

    def __init__(self, k: int, k_max: int | None = None):
        self.k = k
        self.k_max = k_max or 2 * k

    def update(self, proposed: int, accepted: int) -> int:
        if proposed and accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif proposed and accepted < proposed / 2:
            self.k = max(1, self.k - 1)
        return self.k


def speculative_decode(
    verifier: Verifier,
    state: DecodeState,
    proposer: Proposer,
    *,
    max_new_tokens: int,
    k: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_token_ids: Sequence[int] = (),
    adaptive: bool = False,
) -> Iterator[int | SpeculativeStep]:
    """Yield emitted token ids and one :class:`SpeculativeStep` per verifier forward.

    ``verifier`` holds the committed history and ``state.next_logits`` the logits after
    it. When the stream ends every emitted token is committed and ``state.next_logits``
    follows the last one; if the caller abandons the stream, :func:`settle` restores that.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    stops = frozenset(stop_token_ids)
    schedule = AdaptiveK(k) if adaptive else None
    verifier.check_proposer(proposer)  # same backend (torch / mlx) or a clear error
    bind = getattr(proposer, "bind", None)
    if callable(bind):  # proposers that read the verifier's hidden states
        bind(verifier)

    x = sample_token(
        state.next_logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
    )
    state.pending_token = x
    state.emitted = 1
    yield x
    while x not in stops and state.emitted < max_new_tokens:
        room = max_new_tokens - state.emitted  # tokens this step may still emit (>= 1)
        k_now = min(schedule.k if schedule else k, room - 1)
        if k_now > 0:
            context = verifier.history_token_ids + [x]
            draft = proposer.propose(
                context, k_now, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
            draft.tokens = list(draft.tokens)[:k_now]
        else:
            draft = Draft([], None, 0.0)
        t0 = time.perf_counter()
        rows = verifier.forward_block([x] + draft.tokens)
        verifier_s = time.perf_counter() - t0
        state.verifier_s += verifier_s
        state.verifier_forwards += 1
        if temperature == 0.0:
            n, nxt = accept_greedy(rows, draft.tokens)
        else:
            n, nxt = accept_sampled(
                rows, draft, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
        emitted = draft.tokens[:n] + [nxt]  # never more than `room` tokens
        first_stop = next((j for j, t in enumerate(emitted) if t in stops), None)
        if first_stop is not None:
            emitted = emitted[: first_stop + 1]
        # x and the emitted drafts are committed; the verifier's own token is not yet
        in_block = min(len(emitted), n)
        verifier.commit(1 + in_block)
        if k_now > 0:
            proposer.accept(in_block)
        if in_block == len(emitted):  # stopped on an accepted draft: its logits are known
            state.pending_token = None
            state.next_logits = rows[in_block]
        else:
            state.pending_token = emitted[-1]
        step = SpeculativeStep(
            k=k_now, proposed=len(draft.tokens), accepted=n, emitted=len(emitted),
            proposer_s=draft.seconds, verifier_s=verifier_s,
        )
        state.steps.append(step)
        if schedule:
            schedule.update(step.proposed, n)
        yield step
        for token in emitted:
            state.emitted += 1
            yield token
        x = emitted[-1]
        if state.pending_token is None:
            break
    if x in stops:
        state.stop_reason = "stop"
    settle(verifier, state)
