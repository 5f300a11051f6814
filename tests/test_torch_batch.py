"""Several sessions' steps in one forward (kakeya_lab/backends/torch_batch.py) against the
dense masked oracle: sessions at different cache fill levels (some past eviction, some
not), in global and rolling positions, with different budgets, in one batch; one-token
steps and speculative-style blocks with partial commits and rollbacks; sessions joining
and leaving between steps. Then the batcher with real threads: every session's greedy
tokens are its solo run's. Its speed is a benchmark (benchmarks/batch_scaling.py)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from oracle_cases import check_close

from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.backends.torch_batch import (
    BATCH_ROWS,
    MAX_BLOCK,
    BatchForward,
    BatchStep,
    StepBatcher,
    batch_verifier,
    take_batch,
)
from kakeya_lab.backends.torch_lean import LeanForward
from kakeya_lab.linear import kernel_switched
from kakeya_lab.models import tiny_random_model
from kakeya_lab.reference import oracle_logits

TOL = 1e-4

CONFIGS = [
    SinkWindowConfig(sink=3, window=17, positions="global"),
    SinkWindowConfig(sink=3, window=17, positions="rolling"),
    SinkWindowConfig(sink=2, window=29, positions="rolling"),
    SinkWindowConfig(sink=4, window=40, positions="global"),
    SinkWindowConfig(sink=1, window=11, positions="rolling"),
]


class Tracked:
    """A verifier, the tokens it committed and the logits a batch gave each of them."""

    def __init__(self, model, config: SinkWindowConfig, prompt: list[int]):
        self.verifier = Verifier(model, config)
        self.config = config
        self.ids: list[int] = []
        self.rows: list[torch.Tensor] = []
        self.verifier.append(prompt)
        self.ids += prompt
        self.first = len(prompt)  # rows before this came from transformers' prefill

    def check(self, model, name: str, record_tolerance) -> None:
        want = oracle_logits(model, self.ids, self.config)[self.first :]
        got = torch.stack(self.rows)
        check_close(name, got, want, TOL, record_tolerance)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.slow
def test_a_batch_of_sessions_gives_each_its_oracle_logits(architecture, record_tolerance):
    """Five sessions (both position modes, three budgets), prompts from 5 to 70 tokens so
    some are past eviction before the first batch; 90 rounds where a random subset steps
    (joining and leaving), each with one token or a block whose tail is wrong, kept in
    part or rolled back. The logits of every kept row equal the oracle's."""
    loaded = tiny_random_model(architecture, seed=1)
    model = loaded.model
    vocab = model.config.vocab_size
    rng = random.Random(7)
    sessions = [
        Tracked(model, c, [rng.randrange(vocab) for _ in range(n)])
        for c, n in zip(CONFIGS, (5, 30, 70, 12, 50))
    ]
    assert any(s.verifier.history_len > s.config.budget for s in sessions)
    assert any(s.verifier.history_len < s.config.budget for s in sessions)
    forward = BatchForward.of(model)
    sizes = []
    for _ in range(90):
        members = [s for s in sessions if rng.random() < 0.7] or sessions[:1]
        steps, plans = [], []
        for s in members:
            if rng.random() < 0.5:
                good = [rng.randrange(vocab)]
                keep = 1
            else:  # a speculative block: a good prefix, then wrong tokens
                good = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
                keep = rng.randint(0, len(good))
            block = good[:keep] + [(t + 5) % vocab for t in good[keep:]]
            steps.append(BatchStep(s.verifier.cache, block, all_rows=True))
            plans.append((s, good, keep))
        sizes.append(len(steps))
        for (s, good, keep), logits in zip(plans, forward(steps)):
            cache = s.verifier.cache
            if keep == 0 or rng.random() < 0.15:  # rolled back; the true token goes alone
                cache.rollback()
                s.rows.append(s.verifier.append(good[:1]))
                s.ids.append(good[0])
                continue
            cache.commit(keep)  # the cache driven directly (the ids are tracked here)
            s.rows.extend(logits[:keep])
            s.ids.extend(good[:keep])
    assert max(sizes) == len(sessions) and min(sizes) < len(sessions)
    for s in sessions:
        assert s.verifier.cache.history_len == len(s.ids) > 2 * s.config.budget
        assert s.verifier.cache_len <= s.config.budget
        s.check(model, f"tiny {architecture} batch/{s.config}", record_tolerance)


def test_a_failed_batch_leaves_every_cache_as_it_was():
    """A batch that fails part-way (a token outside the vocabulary in its last step)
    leaves every cache of the batch exactly as it was."""
    model = tiny_random_model("llama", seed=1).model
    verifiers = [Verifier(model, c) for c in CONFIGS[:3]]
    for i, v in enumerate(verifiers):
        v.append(list(range(3, 3 + 10 * (i + 1))))
    before = [(v.cache.next_position, v.cache.cached_positions()) for v in verifiers]
    steps = [BatchStep(v.cache, [5, 6], all_rows=True) for v in verifiers]
    steps[-1].token_ids = [5, model.config.vocab_size + 3]
    with pytest.raises(IndexError):
        BatchForward.of(model)(steps)
    assert [(v.cache.next_position, v.cache.cached_positions()) for v in verifiers] == before
    assert all(v.cache.pending_len == 0 for v in verifiers)
    with pytest.raises(ValueError, match="1 to"):
        BatchForward.of(model)([BatchStep(verifiers[0].cache, [1] * (MAX_BLOCK + 1), True)])


def test_a_batch_takes_the_waiting_steps_in_order_while_their_rows_fit():
    """Prompts that arrive together share a forward up to the batch's rows; a step that
    would not fit waits for the next batch, and a lone step larger than the rows still
    runs. The default holds eight 39-token chat prompts and their sessions' steps."""
    model = tiny_random_model("llama", seed=1).model
    cache = [Verifier(model, CONFIGS[0]).cache for _ in range(10)]
    prompts = [BatchStep(cache[i], [5] * 39, all_rows=False) for i in range(8)]
    steps = [BatchStep(cache[8], [7], all_rows=False), BatchStep(cache[9], [7] * 5, True)]
    waiting = prompts + steps
    assert take_batch(waiting, BATCH_ROWS) == waiting
    assert take_batch(waiting, 100) == prompts[:2]
    assert take_batch(steps + prompts, 45) == steps + prompts[:1]
    assert take_batch(prompts, 10) == prompts[:1]
    assert take_batch([], 10) == []
    assert StepBatcher(model).max_rows == BATCH_ROWS


def _greedy(verifier: Verifier, logits: torch.Tensor, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(torch.argmax(logits))
        out.append(token)
        logits = verifier.append([token])
    return out


def test_threads_through_the_batcher_decode_their_solo_greedy_tokens():
    """Six threads, each greedy-decoding its own session (different prompts, modes and
    budgets, past eviction) through one batcher: each thread's tokens are its solo run's,
    and the batcher ran batches of several rows."""
    model = tiny_random_model("qwen3", seed=3).model
    vocab = model.config.vocab_size
    rng = random.Random(11)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    configs = [CONFIGS[i % len(CONFIGS)] for i in range(6)]
    steps = 60
    solo = []
    for prompt, config in zip(prompts, configs):
        v = Verifier(model, config)
        solo.append(_greedy(v, v.append(prompt), steps))
    batcher = StepBatcher(model)
    got: list[list[int] | None] = [None] * 6
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def run(i: int) -> None:
        try:
            v = Verifier(model, configs[i])
            batch_verifier(v, batcher)
            logits = v.append(prompts[i])  # a short prompt is a batched step too
            start.wait()
            got[i] = _greedy(v, logits, steps)
            batcher.leave(v.cache)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == solo
    assert max(batcher.batches) > 1
    assert batcher.forward.rows > batcher.forward.forwards  # rows shared forwards


@pytest.mark.slow  # ~20 s a kernel: the rolling oracle of the default model is token by token
@pytest.mark.parametrize("kernel", ["aten", "split"])
def test_a_batch_of_default_model_sessions_gives_each_its_oracle_logits(
    default_model, text_ids, record_tolerance, kernel
):
    """Four sessions of the default model (global and rolling positions, three budgets,
    one past eviction before the first batch), 40 one-token rounds in one batch each; on
    ``split`` with two threads a batch of 2 to 4 rows runs the compiled few-row product
    (where it builds), in the last rounds (the global sessions alone) inside whole compiled
    layers, and the oracle is that kernel's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if kernel == "split" else threads)
    try:
        with kernel_switched(default_model.model, kernel):
            _batch_of_default_model_sessions(
                default_model.model, text_ids, record_tolerance, kernel
            )
    finally:
        torch.set_num_threads(threads)


def _batch_of_default_model_sessions(model, text_ids, record_tolerance, kernel: str) -> None:
    configs = [
        SinkWindowConfig(sink=4, window=28, positions="global"),
        SinkWindowConfig(sink=4, window=28, positions="rolling"),
        SinkWindowConfig(sink=2, window=50, positions="rolling"),
        SinkWindowConfig(sink=3, window=30, positions="global"),
    ]
    sessions = [
        Tracked(model, c, list(text_ids[o : o + n]))
        for c, o, n in zip(configs, (0, 40, 90, 120), (8, 40, 20, 24))
    ]
    # every block one run of slots: on split, whole layers compile (a rolling cache's sink
    # copies keep a batch's layers one by one)
    global_only = [sessions[0], sessions[3]]
    forward = BatchForward.of(model)
    lean = LeanForward.of(model)
    attend_before = layers_before = 0
    for r in range(40):
        if r == 35:  # every cache is past eviction by now (the first one since round 31)
            assert sessions[0].verifier.cache.history_len > sessions[0].config.budget
            attend_before, layers_before = lean.attend_many_calls, lean.compiled_layer_calls
        # the first leaves every fifth round, then joins again; the rolling ones leave for
        # the last five rounds
        members = global_only if r >= 35 else sessions[1:] if r % 5 == 0 else sessions
        tokens = [text_ids[200 + r + 3 * j] for j in range(len(members))]
        steps = [BatchStep(s.verifier.cache, [t], all_rows=False) for s, t in zip(members, tokens)]
        for s, t, logits in zip(members, tokens, forward(steps)):
            s.verifier.cache.commit(1)
            s.rows.append(logits[-1])
            s.ids.append(t)
    for s in sessions:
        assert s.verifier.cache.history_len > s.config.budget
        s.check(model, f"smollm2 batch {kernel}/{s.config}", record_tolerance)
    if lean.native is not None:  # the compiled several-cache attention ran past eviction:
        # on split (two threads) inside whole compiled layers, else on its own
        if kernel == "split":
            assert lean.compiled_layer_calls > layers_before
        else:
            assert lean.attend_many_calls > attend_before
