"""A long run's folder is the same whoever makes it: ``kakeya-lab long-run`` and notebook
20's calls (``run_long`` + ``save_long_run``) write the same files, the same metrics keys
and the same settings."""

from __future__ import annotations

import json

import pytest

from kakeya_lab.bench.long_run import LongRunSettings, run_long, save_long_run
from kakeya_lab.cli import main
from kakeya_lab.experiments.long_run import Invocation, record_long_run
from kakeya_lab.results import validate_metrics

SETTINGS = dict(arms=("sink_window",), sink=4, window=12, turns=3, max_new_tokens=2)
SETTINGS |= dict(probe_every=0, turns_per_bucket=1, checkpoint_every=1)
CLI = ["--arms", "sink_window", "--sink", "4", "--window", "12", "--turns", "3"]
CLI += ["--max-new-tokens", "2", "--probe-every", "0", "--turns-per-bucket", "1"]
CLI += ["--checkpoint-every", "1", "--quiet"]


def _shape(doc: object) -> object:
    """The keys of a JSON document, nested (lists by their first item), without values."""
    if isinstance(doc, dict):
        return {k: _shape(v) for k, v in doc.items()}
    if isinstance(doc, list) and doc:
        return [_shape(doc[0])]
    return "value"


def _files(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _notebook_style(loaded, settings: LongRunSettings, run_dir) -> dict:
    """What notebook 20's run and save cells do."""
    run = run_long(loaded, settings, out_dir=run_dir, progress=False)
    save_long_run(run_dir, settings, loaded.description, run=run)
    return json.loads((run_dir / "metrics.json").read_text())


def test_cli_writer_and_notebook_calls_write_the_same_files(tmp_path, tiny_model):
    settings = LongRunSettings(**SETTINGS)
    cli_dir, nb_dir = tmp_path / "cli", tmp_path / "notebook"
    record_long_run(
        tiny_model, settings, cli_dir, Invocation(["kakeya-lab", "long-run"], {}), progress=False
    )
    cli_doc = json.loads((cli_dir / "metrics.json").read_text())
    nb_doc = _notebook_style(tiny_model, settings, nb_dir)
    for doc in (cli_doc, nb_doc):
        validate_metrics(doc)
    # run.json is the CLI's own; a notebook's comes from the runner (the same RunRecord)
    assert (
        _files(cli_dir) - {"run.json"}
        == _files(nb_dir)
        == {
            "checkpoint.json",
            "metrics.json",
            "turns.csv",
        }
    )
    assert _shape(cli_doc["metrics"]) == _shape(nb_doc["metrics"])
    assert _shape(cli_doc["headline"]) == _shape(nb_doc["headline"])
    assert set(cli_doc) == set(nb_doc) and cli_doc["settings"] == nb_doc["settings"]
    assert LongRunSettings.from_dict(cli_doc["settings"]) == settings
    # control: a run with another arm set writes another shape, so the comparison can fail
    other = _notebook_style(
        tiny_model, settings.replace(arms=("sink_window", "full_cache")), tmp_path / "other"
    )
    assert _shape(other["metrics"]) != _shape(cli_doc["metrics"])


@pytest.mark.slow  # the real default model through the CLI, then in-process
def test_cli_and_notebook_write_the_same_metrics_keys(tmp_path, aten_model):
    cli_dir, nb_dir = tmp_path / "cli", tmp_path / "notebook"
    assert main(["long-run", str(cli_dir), *CLI]) == 0
    cli_doc = json.loads((cli_dir / "metrics.json").read_text())
    nb_doc = _notebook_style(aten_model, LongRunSettings(**SETTINGS), nb_dir)
    assert _files(cli_dir) - {"run.json"} == _files(nb_dir)
    assert set(cli_doc) == set(nb_doc)
    assert _shape(cli_doc["metrics"]) == _shape(nb_doc["metrics"])
    assert _shape(cli_doc["headline"]) == _shape(nb_doc["headline"])
    assert cli_doc["settings"] == nb_doc["settings"]  # the CLI's flags are the same value
