"""``Verifier.append`` is all-or-nothing, also under ``KeyboardInterrupt`` mid-append."""

from __future__ import annotations

import random

import pytest

from kakeya_lab import SinkWindowConfig, Verifier, reference

TOL = 1e-4


class Interrupt:
    """A forward hook on a real decoder layer's down projection (a module the lean forward
    and transformers' both call) that raises on its ``at``-th call."""

    def __init__(self, at: int, error: type[BaseException]):
        self.at, self.error, self.calls = at, error, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.at:
            raise self.error("interrupted inside the decoder layer")


def _state(v: Verifier) -> tuple:
    return (
        v.history_token_ids,
        v.cached_token_ids,
        v.cached_positions(),
        v.cache_len,
        v.kv_live_bytes,
        v.pending_len,
    )


@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.parametrize(
    "chunk_index,error", [(2, KeyboardInterrupt), (3, KeyboardInterrupt), (2, RuntimeError)]
)
def test_interrupted_multi_chunk_append_changes_nothing(
    tiny_model, mode, chunk_index, error, record_tolerance
):
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=10, positions=mode)
    rng = random.Random(7)
    vocab = model.get_input_embeddings().num_embeddings
    history = [rng.randrange(vocab) for _ in range(3 * config.budget)]  # already evicting
    failed = [rng.randrange(vocab) for _ in range(11)]  # 3 chunks of 4, 4, 3
    retry = [rng.randrange(vocab) for _ in range(9)]

    v = Verifier(model, config, prefill_chunk=4)
    twin = Verifier(model, config, prefill_chunk=4)  # never sees the failed call
    v.append(history)
    twin.append(history)
    assert v.history_len > v.cache_len == config.budget
    before = _state(v)

    layer = model.base_model.layers[-1].mlp.down_proj
    hook = layer.register_forward_hook(Interrupt(chunk_index, error))
    try:
        with pytest.raises(error):
            v.append(failed)
    finally:
        hook.remove()
    assert _state(v) == before == _state(twin)

    got = v.append(retry)
    want = twin.append(retry)
    assert _state(v) == _state(twin)
    diff = (got - want).abs().max().item()
    assert diff == 0.0, f"next append differs from the never-interrupted verifier by {diff:.3e}"
    seq = history + retry
    if mode == "global":
        oracle = reference.dense_logits(model, seq, config)[-1]
    else:
        oracle = reference.rolling_logits(model, seq, config)[-1]
    diff = (got - oracle).abs().max().item()
    record_tolerance(f"tiny-qwen3/{mode}/append after interrupted append", diff)
    assert diff <= TOL


def test_interrupt_in_the_first_chunk_of_an_empty_verifier(tiny_model):
    model = tiny_model.model
    v = Verifier(model, SinkWindowConfig(sink=2, window=6), prefill_chunk=3)
    hook = model.base_model.layers[0].mlp.down_proj.register_forward_hook(
        Interrupt(1, KeyboardInterrupt)
    )
    try:
        with pytest.raises(KeyboardInterrupt):
            v.append([5, 6, 7, 8, 9])
    finally:
        hook.remove()
    assert v.history_len == v.cache_len == v.kv_live_bytes == v.pending_len == 0
    fresh = Verifier(model, SinkWindowConfig(sink=2, window=6), prefill_chunk=3)
    assert (v.append([5, 6, 7, 8, 9]) - fresh.append([5, 6, 7, 8, 9])).abs().max().item() == 0.0
