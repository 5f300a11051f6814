"""The history view proposers read each step: the same sequence as a copy, without one."""

from __future__ import annotations

import random

import pytest

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.verifier import TokenHistory, Verifier


def test_view_reads_like_the_concatenated_list():
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(100) for _ in range(rng.randrange(0, 12))]
        tail = [rng.randrange(100) for _ in range(rng.randrange(0, 3))]
        view, ref = TokenHistory(ids, tail), ids + tail
        assert len(view) == len(ref) and list(view) == ref
        for i in range(-len(ref), len(ref)):
            assert view[i] == ref[i]
        for _ in range(10):
            a, b = rng.randrange(-15, 15), rng.randrange(-15, 15)
            step = rng.choice([1, 1, 2, -1])
            assert view[a:b:step] == ref[a:b:step]
        with pytest.raises(IndexError):
            view[len(ref)]


def test_verifier_view_is_not_a_copy(tiny_model):
    v = Verifier(tiny_model.model, SinkWindowConfig(sink=2, window=6))
    v.append([1, 2, 3])
    view = v.history_view([9])
    assert list(view) == [1, 2, 3, 9]
    v.append([4])  # the view follows the committed history (valid until it changes)
    assert list(view) == [1, 2, 3, 4, 9] and v.history_token_ids == [1, 2, 3, 4]
