"""Strict resume of a drafter training run: other settings are refused, naming the difference.

(The long run and the sweep are covered in test_long_run.py and test_experiments.py.)
Uses the tiny random model: this is about the mechanics of resuming, not quality.
"""

from __future__ import annotations

import pytest
import torch

from kakeya_lab.align.rollouts import (
    CaptureOptions,
    capture_rollouts,
    draft_vocabulary,
    load_rollouts,
)
from kakeya_lab.align.train import RolloutData, TrainConfig, train_drafter
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.data import domain_conversations
from kakeya_lab.proposers.drafters.checkpoint import CheckpointError
from kakeya_lab.proposers.drafters.network import build_drafter, drafter_config_for
from kakeya_lab.resume import ResumeMismatch, differences
from kakeya_lab.session import model_eos_ids

SHAPE = dict(context_len=4, block_size=2)


def test_differences_name_every_changed_leaf():
    assert differences({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 2}}) == ""
    said = differences({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}, "d": 0})
    assert said == "b.c: was 2, now 3; d: was '<absent>', now 0"


@pytest.fixture(scope="module")
def rollouts(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollouts")
    options = CaptureOptions(
        turns_per_conversation=1, max_new_tokens=12, shard_size=4, max_repetition=None
    )
    for split, limit in (("train", 3), ("dev", 1)):
        capture_rollouts(
            tiny_model,
            domain_conversations("chitchat", split, limit=limit),
            root / split,
            config=SinkWindowConfig(sink=4, window=60),
            split=split,
            options=options,
            progress=False,
        )
    train, dev = load_rollouts(root / "train"), load_rollouts(root / "dev")
    return train, dev, draft_vocabulary(train, 512, always=model_eos_ids(tiny_model.model))


def _drafter(tiny_model, vocab):
    torch.manual_seed(0)
    return build_drafter(
        drafter_config_for("feature", tiny_model, vocab, **SHAPE), tiny_model.model
    )


def test_training_resume_refuses_other_settings(tiny_model, rollouts, tmp_path):
    train, dev, vocab = rollouts
    data = RolloutData(train, **SHAPE)
    fewer = RolloutData(train.select(range(len(train) - 1)), **SHAPE)
    cfg = TrainConfig(
        steps=6, batch_size=4, warmup_steps=1, checkpoint_every=2, eval_every=6, eval_windows=8
    )
    train_drafter(_drafter(tiny_model, vocab), data, cfg, tmp_path, stop_after=2, progress=False)
    cases = [
        (
            dict(
                cfg=TrainConfig(
                    steps=6,
                    batch_size=4,
                    warmup_steps=1,
                    checkpoint_every=2,
                    eval_every=6,
                    eval_windows=8,
                    lr=1e-3,
                )
            ),
            "train.lr: was 0.002, now 0.001",
        ),
        (dict(data=fewer), "data."),
        (dict(eval_data=RolloutData(dev, **SHAPE)), "eval_data"),
    ]
    for change, named in cases:
        kwargs = {"data": data, "cfg": cfg, "eval_data": None, **change}
        with pytest.raises(ResumeMismatch, match=named) as info:
            train_drafter(
                _drafter(tiny_model, vocab),
                kwargs["data"],
                kwargs["cfg"],
                tmp_path,
                eval_data=kwargs["eval_data"],
                progress=False,
            )
        assert isinstance(info.value, CheckpointError)  # still a checkpoint error for older callers
    history = train_drafter(_drafter(tiny_model, vocab), data, cfg, tmp_path, progress=False)
    assert list(history["step"]) == list(range(1, 7))  # same settings: resumed and finished
    fresh = train_drafter(
        _drafter(tiny_model, vocab), fewer, cfg, tmp_path, resume=False, progress=False
    )
    assert list(fresh["step"]) == list(range(1, 7))
