"""Every committed notebook reads well without a kernel and survives open-and-save.

Checks on the committed files (no execution): the project's kernel, the byte form JupyterLab
writes (so opening and saving leaves git clean), a ``parameters`` cell, a final conclusion,
a statement of which run the outputs are, figures that render in JupyterLab and in the HTML
export (plotly mime type plus a light HTML fallback; plotly.js is never embedded, the export
adds it once per page), and outputs free of absolute paths, warnings, tracebacks and frozen
progress bars. ``notebooks/`` stays small.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kakeya_lab.notebook_format import KERNEL_NAME, PLOTLY_MIME, jupyterlab_text

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
NOTEBOOKS_MAX_BYTES = 8 * 2**20
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/(?:work|root|home|tmp|Users|private|var/folders)/")
FROZEN_BAR = re.compile(r"\b\d{1,3}%\|")
PLOTLY_JS_BANNER = re.compile(r"\*\s*plotly\.js v\d")  # the top of the plotly.js bundle


def _outputs(nb: dict):
    for index, cell in enumerate(nb["cells"]):
        for output in cell.get("outputs", []):
            yield index, output


def _texts(output: dict) -> list[str]:
    """The human-readable texts of an output."""
    if output["output_type"] == "stream":
        return ["".join(output["text"])]
    if output["output_type"] == "error":
        return ["\n".join(output.get("traceback", [])), output.get("evalue", "")]
    texts = []
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/"):
            texts.append("".join(value) if isinstance(value, list) else value)
    return texts


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"00_quickstart.ipynb", "05_chat.ipynb", "10_sink_window_cache.ipynb"} <= names


def test_the_notebook_map_lists_every_notebook_with_its_committed_run_time():
    """notebooks/README.md has a row per notebook whose CI size is the committed run's own
    papermill duration (re-running a notebook means updating its row)."""
    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in (NOTEBOOKS[0].parent / "README.md").read_text().splitlines()
        if line.startswith("| `")
    }
    assert sorted(rows) == sorted(p.stem for p in NOTEBOOKS)
    for path in NOTEBOOKS:
        duration = json.loads(path.read_text())["metadata"]["papermill"]["duration"]
        ci_size = rows[path.stem].split("|")[4].strip()
        assert ci_size.startswith(f"{round(duration):,} s"), (path.stem, ci_size, duration)


def test_the_notebooks_stay_small():
    total = sum(p.stat().st_size for p in NOTEBOOKS)
    assert total < NOTEBOOKS_MAX_BYTES, f"notebooks/ holds {total / 2**20:.1f} MiB"


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.stem)
def notebook(request) -> tuple[Path, str, dict]:
    text = request.param.read_text(encoding="utf-8")
    return request.param, text, json.loads(text)


def test_names_the_project_kernel(notebook):
    _, _, nb = notebook
    spec = nb["metadata"]["kernelspec"]
    assert spec["name"] == KERNEL_NAME and spec["display_name"] == KERNEL_NAME, spec


def test_is_stored_as_jupyterlab_saves_it(notebook):
    path, text, nb = notebook
    assert text == jupyterlab_text(nb), (
        f"{path.name} would change on open-and-save in JupyterLab: "
        f"run `python -m kakeya_lab.notebook_format {path.name}`"
    )
    assert "widgets" not in nb["metadata"], "frozen widget state committed"


def test_a_text_is_split_as_the_save_splits_it():
    """A stored list ending in "" after a final newline (an editor's split, not nbformat's)
    is not what JupyterLab saves: it comes back without the "" (20_long_run once did)."""
    nb = {
        "cells": [
            {
                "cell_type": "markdown",
                "id": "t",
                "metadata": {},
                "source": ["# t\n", "\n", "last\n", ""],
            }
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    saved = json.loads(jupyterlab_text(nb))
    assert saved["cells"][0]["source"] == ["# t\n", "\n", "last\n"]


def test_has_a_parameters_cell_and_ends_with_a_conclusion(notebook):
    path, _, nb = notebook
    tagged = [c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1 and tagged[0]["cell_type"] == "code", path.name
    last = nb["cells"][-1]
    source = "".join(last["source"])
    assert last["cell_type"] == "markdown" and source.startswith("## Conclusion"), path.name
    body = source.removeprefix("## Conclusion").strip()
    assert len(body) > 80 and "CONCLUSION" not in body, f"{path.name}: the conclusion says nothing"
    assert re.search(r"\d", body), f"{path.name}: the conclusion cites no number"


def test_says_which_run_its_outputs_are(notebook):
    path, _, nb = notebook
    intro = "".join(nb["cells"][0]["source"])
    assert nb["cells"][0]["cell_type"] == "markdown" and intro.startswith("# ")
    assert re.search(r"outputs (below )?(are|come from)", intro), (
        f"{path.name}: the introduction must say whether the committed outputs are the "
        "docs/results.md run or a small CI run (with the command for the full one)"
    )
    assert "../shared" not in json.dumps(nb) and "DESIGN.md" not in json.dumps(nb)


def test_is_committed_executed(notebook):
    path, _, nb = notebook
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["execution_count"] is not None for c in code), (
        f"{path.name} is not executed"
    )


def test_outputs_hold_no_absolute_paths_warnings_tracebacks_or_frozen_bars(notebook):
    path, _, nb = notebook
    problems = []
    for index, output in _outputs(nb):
        if output["output_type"] == "error":
            problems.append(f"cell {index}: error output {output.get('ename')}")
        if output["output_type"] == "stream" and output["name"] == "stderr":
            text = "".join(output["text"])
            if "warn" in text.lower():
                problems.append(f"cell {index}: warning on stderr: {text[:120]!r}")
        if WIDGET_MIME in output.get("data", {}):
            fallback = "".join(output["data"].get("text/plain", ""))
            if FROZEN_BAR.search(fallback) or "it/s" in fallback:
                problems.append(f"cell {index}: frozen progress-bar widget {fallback[:60]!r}")
        for text in _texts(output):
            if ABSOLUTE_PATH.search(text):
                problems.append(
                    f"cell {index}: absolute path {ABSOLUTE_PATH.search(text).group(0)!r}"
                )
            if "Traceback (most recent call last)" in text:
                problems.append(f"cell {index}: traceback")
            if FROZEN_BAR.search(text) and "|" in text:
                problems.append(f"cell {index}: progress bar text {text[:60]!r}")
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_figures_carry_the_mime_type_and_a_light_fallback(notebook):
    path, text, nb = notebook
    assert not PLOTLY_JS_BANNER.search(text), (
        f"{path.name} embeds plotly.js: run `python -m kakeya_lab.notebook_format {path.name}`"
    )
    for index, output in _outputs(nb):
        data = output.get("data", {})
        html = "".join(data.get("text/html", ""))
        if PLOTLY_MIME in data:  # JupyterLab draws the mime type, the HTML export the fallback
            assert data[PLOTLY_MIME].get("data") is not None, f"{path.name} cell {index}"
            assert "Plotly.newPlot" in html and 'class="plotly-graph-div"' in html, (
                f"{path.name} cell {index}: a figure without its HTML fallback"
            )
        else:
            assert "Plotly.newPlot" not in html, f"{path.name} cell {index}: HTML-only figure"
