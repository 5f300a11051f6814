"""Result files: self-describing header, atomic JSON, no NaN in JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kakeya_lab.results import run_header, write_json_atomic, write_metrics


def test_metrics_are_self_describing_and_json_clean(tmp_path, tiny_model):
    header = run_header(
        experiment="e",
        run_id="r1",
        model=tiny_model.description,
        dtype="float32",
        cache={"sink": 4, "window": 60, "positions": "global"},
        seed=3,
    )
    path = write_metrics(
        tmp_path,
        header,
        {"x": float("nan"), "y": np.float32(1.5), "z": [np.inf, 2]},
        headline={"y": 1.5},
    )
    doc = json.loads(path.read_text())
    for key in (
        "schema_version",
        "experiment",
        "run_id",
        "model",
        "backend",
        "dtype",
        "sink",
        "window",
        "positions",
        "proposer",
        "seed",
        "git_commit",
        "packages",
        "hardware",
        "started",
        "ended",
    ):
        assert key in doc, key
    assert (
        doc["model"]["random"] is True
        and doc["model"]["weight_sha256"] == tiny_model.description.weight_sha256
    )
    assert doc["metrics"] == {"x": None, "y": 1.5, "z": [None, 2]}
    assert doc["headline"] == {"y": 1.5}
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed into place


def test_atomic_write_replaces_whole_files(tmp_path):
    target = tmp_path / "a.json"
    write_json_atomic(target, {"v": list(range(1000))})
    write_json_atomic(target, {"v": 1})
    assert json.loads(target.read_text()) == {"v": 1}


def test_run_header_refuses_an_anonymous_model(tiny_model):
    from kakeya_lab.results import ResultSchemaError

    with pytest.raises(ResultSchemaError, match="model="):
        run_header(experiment="e", run_id="r", model=None)
    drift = {"first_p50_s": 0.1, "last_p50_s": 0.1, "drift_s": 0.0}  # what notebook 00 once passed
    with pytest.raises(ResultSchemaError, match="name or weight_sha256"):
        run_header(experiment="e", run_id="r", model=drift)
    with pytest.raises(ResultSchemaError, match="ModelDescription"):
        run_header(experiment="e", run_id="r", model=42)
    with pytest.raises(ResultSchemaError, match="overwrite"):
        run_header(experiment="e", run_id="r", model=tiny_model.description, extra={"model": "x"})


def test_write_metrics_names_the_bad_field_and_writes_nothing(tmp_path, tiny_model):
    from kakeya_lab.results import ResultSchemaError

    header = run_header(
        experiment="e",
        run_id="r",
        model=tiny_model.description,
        cache={"sink": 4, "window": 60, "positions": "global"},
    )
    for field, value, said in (
        ("positions", "both", "positions"),
        ("window", -3, "window"),
        ("experiment", "", "experiment"),
        ("model", {"name": "m"}, "model"),
    ):
        bad = {**header, field: value}
        with pytest.raises(ResultSchemaError, match=said):
            write_metrics(tmp_path, bad, {"x": 1})
    with pytest.raises(ResultSchemaError, match="weight_sha256"):
        write_metrics(
            tmp_path, {**header, "model": {**header["model"], "weight_sha256": "abc"}}, {}
        )
    missing = {k: v for k, v in header.items() if k != "git_commit"}
    with pytest.raises(ResultSchemaError, match="git_commit"):
        write_metrics(tmp_path, missing, {})
    assert not list(tmp_path.iterdir())


def test_the_compiled_schema_and_jsonschema_agree(tiny_model):
    """``validate_metrics`` passes a document on the compiled validator alone: it must refuse
    every document jsonschema refuses (and pass the ones it passes), field by field, the
    date-time formats fastjsonschema's own pattern would pass included."""
    import fastjsonschema
    import jsonschema

    from kakeya_lab.results import METRICS_SCHEMA, _compiled_schema, now_iso

    reference = jsonschema.Draft202012Validator(
        METRICS_SCHEMA, format_checker=jsonschema.FormatChecker()
    )
    doc = {
        **run_header(experiment="e", run_id="r", model=tiny_model.description),
        "ended": now_iso(),
        "headline": {},
        "metrics": {},
    }
    model = doc["model"]
    cases = {
        "valid": doc,
        "schema version": {**doc, "schema_version": 2},
        "empty experiment": {**doc, "experiment": ""},
        "short sha": {**doc, "model": {**model, "weight_sha256": "abc"}},
        "upper-case sha": {**doc, "model": {**model, "weight_sha256": "A" * 64}},
        "negative sink": {**doc, "sink": -1},
        "window 0": {**doc, "window": 0},
        "fractional window": {**doc, "window": 1.5},
        "no window": {**doc, "window": None},
        "positions": {**doc, "positions": "both"},
        "a package version": {**doc, "packages": {"torch": 2}},
        "a date": {**doc, "started": "2026-11-30"},
        "a time without zone": {**doc, "ended": "2026-11-30T01:02:03"},
        "an offset without colon": {**doc, "ended": "2026-11-30T01:02:03+0000"},
        "second 60": {**doc, "ended": "2026-11-30T01:02:60Z"},
        "lower-case t and z": {**doc, "ended": "2026-11-30t01:02:03z"},
        "an offset": {**doc, "ended": "2026-11-30T01:02:03.5+01:00"},
        "a month 13": {**doc, "ended": "2026-13-30T01:02:03Z"},
        "no git commit": {k: v for k, v in doc.items() if k != "git_commit"},
    }
    for name, case in cases.items():
        refused = bool(list(reference.iter_errors(case)))
        try:
            _compiled_schema()(case)
            fast_refused = False
        except fastjsonschema.JsonSchemaException:
            fast_refused = True
        assert fast_refused == refused, (name, refused)
    assert not list(reference.iter_errors(doc))


def test_files_are_written_with_normal_permissions(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "a.json", {"v": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


WRITER = """
import importlib.util, sys, time
# durable.py alone (importing the package would pull in torch: seconds per test)
spec = importlib.util.spec_from_file_location('durable', sys.argv[2])
durable = importlib.util.module_from_spec(spec)
spec.loader.exec_module(durable)

def stall(fh):
    fh.write(b'{"partial": ' + b'1' * 100000)
    fh.flush()
    print('writing', flush=True)
    time.sleep(600)

durable.write_atomic(sys.argv[1], stall)
"""


def test_a_killed_writer_leaves_no_partial_file_and_its_temp_is_cleaned_up(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    target = tmp_path / "metrics.json"
    write_json_atomic(target, {"v": "old"})
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target), str(root / "kakeya_lab" / "durable.py")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    stale = list(tmp_path.glob(".metrics.json.*.tmp"))
    assert len(stale) == 1 and stale[0].stat().st_size >= 100000  # what the killed writer left
    assert json.loads(target.read_text()) == {"v": "old"}  # the old file is whole
    write_json_atomic(tmp_path / "other.json", {"v": 2})  # the next write in this folder cleans up
    assert not list(tmp_path.glob(".*.tmp"))
    assert json.loads(target.read_text()) == {"v": "old"}


def test_csv_and_parquet_are_written_atomically(tmp_path):
    import pandas as pd

    from kakeya_lab.durable import write_csv_atomic, write_parquet_atomic

    table = pd.DataFrame({"turn": [0, 1], "latency_s": [0.5, float("nan")]})
    write_csv_atomic(tmp_path / "t.csv", table)
    write_parquet_atomic(tmp_path / "t.parquet", table)
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "t.csv"), table)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "t.parquet"), table)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv", "t.parquet"]


def test_summary_lines_state_the_verdicts_and_where_the_figures_are(tmp_path):
    """What ``kakeya-lab run`` prints at the end (the committed quickstart evidence, and a
    folder with a figure): one line per arm with both verdicts and the turn latency."""
    import shutil

    from kakeya_lab.results import summary_lines

    evidence = Path(__file__).resolve().parent.parent / "evidence" / "quickstart"
    doc = json.loads((evidence / "metrics.json").read_text())
    lines = summary_lines(evidence)
    arms = doc["metrics"]["arms"]
    assert len(lines) == len(doc["headline"]) == len(arms)
    for line, (arm, summary) in zip(lines, arms.items()):
        p50 = summary["latency"]["turn_latency_s"]["p50"]
        kv = "yes" if doc["headline"][arm]["kv_bounded"] else "NO"
        assert line.startswith(f"{arm}: KV bounded {kv}, prefill bounded ")
        assert f"p50 {p50:.2f} s" in line
    shutil.copy(evidence / "metrics.json", tmp_path / "metrics.json")
    (tmp_path / "kv_bytes.html").write_text("<html></html>")
    assert summary_lines(tmp_path)[-1] == f"figures in {tmp_path}: kv_bytes.html"
    assert summary_lines(tmp_path / "nothing-here") == []
