"""Result files: self-describing header, atomic JSON, no NaN in JSON."""

from __future__ import annotations

import json

import numpy as np

from kakeya_lab.results import run_header, write_json_atomic, write_metrics


def test_metrics_are_self_describing_and_json_clean(tmp_path, tiny_model):
    header = run_header(experiment="e", run_id="r1", model=tiny_model.description, dtype="float32",
                        cache={"sink": 4, "window": 60, "positions": "global"}, seed=3)
    path = write_metrics(tmp_path, header, {"x": float("nan"), "y": np.float32(1.5), "z": [np.inf, 2]},
                         headline={"y": 1.5})
    doc = json.loads(path.read_text())
    for key in ("schema_version", "experiment", "run_id", "model", "backend", "dtype", "sink", "window",
                "positions", "proposer", "seed", "git_commit", "packages", "hardware", "started", "ended"):
        assert key in doc, key
    assert doc["model"]["random"] is True and doc["model"]["weight_sha256"] == tiny_model.description.weight_sha256
    assert doc["metrics"] == {"x": None, "y": 1.5, "z": [None, 2]}
    assert doc["headline"] == {"y": 1.5}
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed into place


def test_atomic_write_replaces_whole_files(tmp_path):
    target = tmp_path / "a.json"
    write_json_atomic(target, {"v": list(range(1000))})
    write_json_atomic(target, {"v": 1})
    assert json.loads(target.read_text()) == {"v": 1}
