"""The incremental paths every backend's cache is checked with against the oracles.

Shared by tests/test_oracle.py (torch), tests/test_rollback.py and tests/test_mlx.py (MLX),
so the torch and MLX backends face exactly the same sequences of appends, blocks, commits
and rollbacks. Each path drives a real :class:`~kakeya_lab.Verifier` and returns the logits
it produced; the oracle is :func:`kakeya_lab.reference.oracle_logits`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from kakeya_lab import SinkWindowConfig, Verifier, reference
from kakeya_lab.backends.torch_lean import MAX_TOKENS  # the longest lean block


def token_by_token(model, ids: Sequence[int], config: SinkWindowConfig, **options):
    """One append per token: ``([n, vocab] logits, verifier)``. ``options`` go to the
    :class:`~kakeya_lab.Verifier`."""
    v = Verifier(model, config, **options)
    return torch.stack([v.append([t]) for t in ids]), v


def chunked(model, ids: Sequence[int], config: SinkWindowConfig, rng: random.Random, **options):
    """Blocks of random sizes (1 to 4 past the longest lean block, so that chunks mix the
    lean step and transformers' forward on torch), each scored then committed, with a
    random prefill chunk; plus one multi-chunk append of the whole sequence on a fresh
    verifier.
    ``options`` go to every :class:`~kakeya_lab.Verifier`.
    Returns ``([n, vocab] logits, last row of the single append, verifier)``."""
    v = Verifier(model, config, prefill_chunk=rng.randint(3, 9), **options)
    rows, i = [], 0
    while i < len(ids):
        chunk = list(ids[i : i + rng.randint(1, MAX_TOKENS + 4)])
        # append returns only the last row; score the chunk as a block to see every row
        rows.append(v.forward_block(chunk))
        v.commit(len(chunk))
        i += len(chunk)
    last = Verifier(model, config, prefill_chunk=rng.randint(3, 9), **options).append(list(ids))
    return torch.cat(rows), last, v


def blocks_with_rollback(
    model, ids: Sequence[int], config: SinkWindowConfig, rng: random.Random, **options
):
    """Speculative-style: score a block (1 token up to the longest lean block) with wrong
    tail tokens, keep a prefix (or roll the whole block back), feed the true token alone
    when nothing was kept. ``options`` go to the :class:`~kakeya_lab.Verifier`.
    Returns ``([n, vocab] logits of the kept rows, verifier)``."""
    ids = list(ids)
    v = Verifier(model, config, **options)
    rows = [v.append(ids[:1])]
    i = 1
    while i < len(ids):
        good = ids[i : i + rng.randint(1, MAX_TOKENS)]
        keep = rng.randint(0, len(good))
        wrong = good[:keep] + [(t + 7) % v.vocab_size for t in good[keep:]]
        logits = v.forward_block(wrong)
        if rng.random() < 0.3:
            v.rollback()
            continue
        v.commit(keep)
        rows[i : i + keep] = list(logits[:keep])
        i += keep
        if keep == 0:  # nothing accepted: the true token alone (what plain decoding does)
            rows.append(v.append([ids[i]]))
            i += 1
    return torch.stack(rows), v


def random_interleavings(
    v: Verifier,
    torch_model,
    rng: random.Random,
    operations: int,
    *,
    dense: bool = False,
) -> tuple[float, int]:
    """``operations`` random append / forward_block / commit / rollback calls on ``v``,
    every forward compared with the torch single-token reference (kept incrementally:
    committed tokens once, each open block on a fork), or, with ``dense``, with the dense
    masked forward over the whole sequence (global mode only). Leaves ``v`` with its open
    block, if any, uncommitted. Returns (worst max-abs logit difference, forwards checked)."""
    config = v.config
    committed_ref = reference.RollingReference(torch_model, config)
    open_ref: reference.RollingReference | None = None
    pending: list[int] = []
    worst, checks = 0.0, 0
    vocab = v.vocab_size
    want_of: Callable[[list[int], int, torch.Tensor], torch.Tensor]
    if dense:
        want_of = lambda seq, rows, _: reference.dense_logits(torch_model, seq, config)[-rows:]  # noqa: E731
    else:
        want_of = lambda _seq, _rows, rolling: rolling  # noqa: E731
    for _ in range(operations):
        op = rng.random()
        if not pending and (v.history_len == 0 or op < 0.25):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            got = v.append(ids)[None]
            want = want_of(v.history_token_ids, 1, committed_ref.extend(ids)[-1:])
        elif op < 0.65:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            got = v.forward_block(ids)
            open_ref = open_ref or committed_ref.copy()
            pending += ids
            want = want_of(v.history_token_ids + pending, len(ids), open_ref.extend(ids))
        elif op < 0.85 and pending:
            n = rng.randint(0, len(pending))
            v.commit(n)
            if n:
                committed_ref.extend(pending[:n])
            pending, open_ref = [], None
            continue
        else:
            v.rollback()
            pending, open_ref = [], None
            continue
        worst = max(worst, (got - want).abs().max().item())
        checks += 1
        assert v.cache_len <= config.budget
    return worst, checks


def check_close(name: str, got, want, tol: float, record_tolerance) -> None:
    """Record the max-abs logit difference under ``name`` and fail past ``tol``."""
    diff = (got - want).abs().max().item()
    record_tolerance(name, diff)
    assert diff <= tol, f"{name}: max-abs logit difference {diff:.3e} > {tol}"


SMALL_VOCAB = 8


def small_vocab_model(seed: int):
    """A 2-layer random Qwen3 over an 8-token vocabulary with sink-window attention, its
    logits scaled up so distributions have a real spread: what the chi-square tests of
    rejection sampling (chains and trees) need, where every token gets many draws."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kakeya_lab.backends.torch_attention import enable_sink_window_attention

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=SMALL_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return enable_sink_window_attention(model)
