"""The anchor: mlx-lm's RotatingKVCache under its own speculative decoding vs our cache."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("mlx_lm")

from kakeya_lab.backends.mlx_backend import load_mlx_model  # noqa: E402
from kakeya_lab.bench.rotating_anchor import run_rotating_anchor  # noqa: E402
from kakeya_lab.models import tiny_random_model  # noqa: E402


@pytest.mark.slow
def test_rotating_cache_departs_from_greedy_past_the_window_ours_does_not(tmp_path):
    loaded = tiny_random_model("llama", seed=0, num_layers=4)
    loaded.model.save_pretrained(tmp_path, safe_serialization=True)
    model = load_mlx_model(tmp_path)
    rng = random.Random(2)
    prompt = [rng.randrange(1000, 40000) for _ in range(40)]  # past sink + window = 16
    result = run_rotating_anchor(
        model, prompt, sink=4, window=12, new_tokens=40, num_draft_tokens=4, draft_layers=1
    )
    print(result.summary())
    assert result.ours_departure_index is None, result.summary()
    assert result.ours_greedy == result.ours_speculative
    assert len(result.rotating_speculative) == len(result.rotating_greedy) == 40
    # mlx-lm 0.32.2: rejected drafts cannot be trimmed once the rotating cache is full
    assert result.rotating_rejections_past_wrap > 0, result.summary()
    assert result.rotating_departure_index is not None, (
        "mlx-lm's speculative stream over RotatingKVCache equals its greedy stream: the rewind "
        "bug may be fixed in this mlx-lm version\n" + result.summary()
    )
