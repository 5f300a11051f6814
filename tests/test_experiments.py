"""Experiment runner: a real 2x2 sweep through papermill, skips, recorded failures, index."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from kakeya_lab.cli import main as cli_main
from kakeya_lab.experiments import ResumeMismatch, build_index, load_sweep, run_notebook, run_sweep


def _notebook(path):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell(
        "a = 1\nb = 2\nrun_dir = None\nrun_id = None\nexperiment = 'tiny'"
    )
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny"),
        params,
        nbformat.v4.new_code_cell(
            "from kakeya_lab.results import run_header, write_metrics\n"
            "model = {'name': 'arithmetic (no model)', 'weight_sha256': '0' * 64, 'architecture': None, 'random': True}\n"
            "if a < 0:\n    raise ValueError('a must be >= 0')\n"
            "total = a * 10 + b\n"
            "if run_dir:\n"
            "    write_metrics(run_dir, run_header(experiment=experiment, run_id=run_id, model=model), {'total': total}, headline={'total': total, 'nested': {'a': a}})\n"
            "print(total)"
        ),
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)
    return path


@pytest.fixture
def sweep_file(tmp_path):
    _notebook(tmp_path / "tiny.ipynb")
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny\nnotebook: tiny.ipynb\nrepeats: 1\nexecutor: local\n"
        "grid:\n  a: [0, 1]\n  b: [5, 6]\n"
        "profiles:\n  smoke: {}\n"
    )
    return path


@pytest.mark.slow  # papermill kernels: tens of seconds
def test_sweep_runs_skips_and_indexes(sweep_file, tmp_path):
    results = tmp_path / "results"
    first = run_sweep(sweep_file, profile="smoke", results_root=results, progress=False)
    assert sorted(first["status"]) == ["completed"] * 4
    index = pd.read_parquet(results / "index.parquet")
    assert len(index) == 4 and set(index["status"]) == {"completed"}
    totals = sorted(zip(index["param.a"], index["param.b"], index["metric.total"]))
    assert totals == [(0, 5, 5), (0, 6, 6), (1, 5, 15), (1, 6, 16)]
    assert set(index["metric.nested.a"]) == {0, 1}
    for run_dir in index["run_dir"]:
        names = {p.name for p in Path(run_dir).iterdir()}
        assert {"notebook.ipynb", "metrics.json", "run.json"} <= names
    again = run_sweep(sweep_file, profile="smoke", results_root=results, progress=False)
    assert sorted(again["status"]) == ["skipped"] * 4


@pytest.mark.slow  # papermill kernels: tens of seconds
def test_failing_runs_are_recorded_and_the_sweep_goes_on(sweep_file, tmp_path):
    results = tmp_path / "results"
    path = tmp_path / "mixed.yaml"
    path.write_text("name: mixed\nnotebook: tiny.ipynb\ngrid:\n  a: [-1, 0]\n  b: [5, 6]\n")
    out = run_sweep(path, results_root=results, progress=False)
    assert sorted(out["status"]) == ["completed", "completed", "failed", "failed"]
    index = build_index(results)
    failed = index[index["status"] == "failed"]
    assert sorted(failed["param.a"]) == [-1, -1]
    assert failed["error"].str.contains("a must be >= 0").all()
    assert sorted(index[index["status"] == "completed"]["metric.total"]) == [5, 6]
    run = json.loads((results / "mixed" / failed["run_id"].iloc[0] / "run.json").read_text())
    assert run["status"] == "failed" and run["error"]["type"] == "PapermillExecutionError"
    # a re-run retries the failed runs only
    again = run_sweep(path, results_root=results, progress=False)
    assert sorted(again["status"]) == ["failed", "failed", "skipped", "skipped"]


def test_unknown_parameter_fails_that_run_only(sweep_file, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("name: typo\nnotebook: tiny.ipynb\ngrid:\n  a: [1]\n  c: [3]\n")
    out = run_sweep(path, results_root=tmp_path / "results", progress=False)
    assert list(out["status"]) == ["failed"] and "unknown parameter" in out["error"].iloc[0]
    with pytest.raises(ValueError, match="unknown parameter"):
        run_notebook(tmp_path / "tiny.ipynb", {"c": 3}, results_root=tmp_path / "results")


def test_bad_sweep_files_are_clear_errors(tmp_path, capsys):
    (tmp_path / "x.yaml").write_text("grid: {a: [1]}\n")
    with pytest.raises(ValueError, match="notebook"):
        load_sweep(tmp_path / "x.yaml")
    (tmp_path / "y.yaml").write_text("notebook: missing.ipynb\n")
    with pytest.raises(ValueError, match="not found"):
        load_sweep(tmp_path / "y.yaml")
    assert cli_main(["sweep", str(tmp_path / "y.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.slow  # papermill kernels: tens of seconds
def test_resume_refuses_runs_of_an_edited_notebook(sweep_file, tmp_path):
    results = tmp_path / "results"
    path = tmp_path / "one.yaml"
    path.write_text("name: one\nnotebook: tiny.ipynb\ngrid:\n  a: [1]\n")
    assert list(run_sweep(path, results_root=results, progress=False)["status"]) == ["completed"]
    nb = nbformat.read(tmp_path / "tiny.ipynb", as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace("a * 10 + b", "a * 100 + b")
    nbformat.write(nb, tmp_path / "tiny.ipynb")
    with pytest.raises(ResumeMismatch, match="notebook_sha256"):
        run_sweep(path, results_root=results, progress=False)
    assert cli_main(["sweep", str(path), "--results", str(results), "--quiet"]) == 2
    again = run_sweep(path, results_root=results, progress=False, force_new=True)
    assert list(again["status"]) == ["completed"]
    assert list(build_index(results)["metric.total"]) == [102]


def test_run_folders_share_one_plotly_js(tmp_path):
    import plotly.graph_objects as go

    from kakeya_lab.results import mark_results_root, save_figure

    root = mark_results_root(tmp_path / "results")
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 2]))
    a = save_figure(fig, root / "exp" / "r1", "f")
    b = save_figure(fig, root / "exp" / "r2", "f")
    assert (root / "plotly.min.js").stat().st_size > 1_000_000
    for html in (a, b):
        assert 'src="../../plotly.min.js"' in html.read_text()
        assert html.stat().st_size < 100_000
        assert not list(html.parent.glob("*.js"))


@pytest.mark.slow  # a real two-node Ray cluster and papermill kernels
def test_sweep_on_a_real_two_node_ray_cluster_brings_every_run_to_the_driver(sweep_file, tmp_path):
    """Both ways of reaching a cluster: a Ray already initialised in this process (as in a
    notebook), then the CLI joining by address; a grown grid skips the runs already there."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from ray.cluster_utils import Cluster

    area = tmp_path / "nodes"  # each node writes under <area>/kakeya_ray/<node-id>/
    path = tmp_path / "twonode.yaml"

    def write_sweep(values: list[int]) -> None:
        path.write_text(
            "name: twonode\nnotebook: tiny.ipynb\nexecutor: ray\n"
            f"ray: {{num_cpus: 1, worker_area: '{area}'}}\ngrid:\n  a: {values}\n"
        )

    small = {
        "num_cpus": 1,
        "object_store_memory": 80 * 1024**2,
        "include_dashboard": False,
    }
    results = tmp_path / "driver_results"
    cluster = Cluster(initialize_head=True, head_node_args=small)
    try:
        cluster.add_node(**{k: v for k, v in small.items() if k != "include_dashboard"})
        cluster.wait_for_nodes()
        write_sweep([2, 3])
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        try:
            first = run_sweep(path, results_root=results, progress=False)
            assert ray.is_initialized()  # the sweep leaves a Ray it did not start
        finally:
            ray.shutdown()
        assert sorted(first["status"]) == ["completed"] * 2
        write_sweep([2, 3, 4, 5])
        command = ["sweep", str(path), "--ray-address", cluster.address]
        assert cli_main([*command, "--results", str(results), "--quiet"]) == 0
        out = run_sweep(path, results_root=results, progress=False, ray_address=cluster.address)
    finally:
        cluster.shutdown()
    assert sorted(out["status"]) == ["skipped"] * 4  # the driver's folders are complete runs
    index = pd.read_parquet(results / "index.parquet")
    assert sorted(index["metric.total"]) == [22, 32, 42, 52]
    assert set(index["status"]) == {"completed"} and len(index) == 4
    for run_dir in index["run_dir"]:
        run_dir = Path(run_dir)
        assert run_dir.parent.parent == results and (run_dir / "notebook.ipynb").is_file()
        record = json.loads((run_dir / "run.json").read_text())
        assert record["notebook"] == str(sweep_file.parent / "tiny.ipynb")
    # the runs were written on both nodes, each in its own area, and removed there once packed
    node_areas = sorted(p.name for p in (area / "kakeya_ray").iterdir())
    assert len(node_areas) == 2, node_areas
    assert not list((area / "kakeya_ray").glob("*/results/twonode/*/run.json"))
