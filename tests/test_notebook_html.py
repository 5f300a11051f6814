"""The offline HTML export (``make html``): plotly.js once per page, every figure present.

The export of the committed notebooks, checked as files (the browser check that the figures
draw with the network off is ``test_browser.py::test_html_export_shows_the_figures_offline``),
and a notebook executed by the experiment runner: its figures come out light (no plotly.js in
the notebook), and its page, written into the run folder, loads the results tree's one
``plotly.min.js``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from kakeya_lab.notebook_format import PLOTLY_MIME, is_plotly_js_bundle, jupyterlab_text
from kakeya_lab.notebook_html import export_html, main
from kakeya_lab.results import PLOTLY_JS

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PLOTLY_JS_BANNER = re.compile(r"\*\s*plotly\.js v\d")
FIGURE_DIV = re.compile(r'<div [^>]*class="plotly-graph-div"')


def _figure_count(notebook: dict) -> int:
    return sum(
        PLOTLY_MIME in output.get("data", {})
        for cell in notebook["cells"]
        for output in cell.get("outputs", [])
    )


def _plotly_scripts(html: str) -> list[str]:
    return re.findall(r'<script src="([^"]*plotly[^"]*\.js)"></script>', html)


def test_pages_of_the_committed_notebooks_load_plotly_js_once(tmp_path):
    out = tmp_path / "html"
    names = ["10_sink_window_cache", "30_speculative", "05_chat"]
    assert main(["--out", str(out), *(str(NOTEBOOKS / f"{n}.ipynb") for n in names)]) == 0
    assert (out / PLOTLY_JS).stat().st_size > 1_000_000
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [PLOTLY_JS, *(f"{n}.html" for n in names)]
    )
    for name in names:
        figures = _figure_count(json.loads((NOTEBOOKS / f"{name}.ipynb").read_text()))
        html = (out / f"{name}.html").read_text()
        assert not PLOTLY_JS_BANNER.search(html), f"{name}: plotly.js inlined"
        assert len(FIGURE_DIV.findall(html)) == figures, name
        if figures:
            assert _plotly_scripts(html) == [PLOTLY_JS], name
            # plotly.js loads in the head, before the first figure's script runs
            assert html.index(f'src="{PLOTLY_JS}"') < html.index("</head>")
            assert html.index("</head>") < html.index("Plotly.newPlot")
        else:
            assert _plotly_scripts(html) == [], f"{name} has no figure but loads plotly.js"


def test_a_missing_notebook_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--out", str(tmp_path), str(tmp_path / "nope.ipynb")])
    assert exit_info.value.code == 2
    assert "no such notebook" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no notebook at"):
        export_html(tmp_path / "nope.ipynb", tmp_path)


def _plotting_notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("run_dir = None\nrun_id = None\nexperiment = 'plots'")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        nbformat.v4.new_markdown_cell("# plots"),
        params,
        nbformat.v4.new_code_cell(
            "import plotly.graph_objects as go\n"
            "import plotly.io as pio\n"
            "from kakeya_lab.plots import use_notebook_renderer\n"
            "use_notebook_renderer()\n"
            "go.Figure(go.Scatter(x=[0, 1], y=[1, 2])).show()\n"
            "go.Figure(go.Bar(x=['a', 'b'], y=[3, 4])).show()"
        ),
        # plotly's own notebook renderer, as the notebooks used it: it embeds plotly.js
        nbformat.v4.new_code_cell(
            "pio.renderers.default = 'plotly_mimetype+notebook'\n"
            "go.Figure(go.Scatter(x=[0, 1], y=[2, 1])).show()"
        ),
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)
    return path


@pytest.mark.slow  # a papermill kernel
def test_executed_notebooks_carry_light_figures_and_export_into_their_run_folder(tmp_path):
    from kakeya_lab.experiments import run_notebook

    results = tmp_path / "results"
    run_dir = run_notebook(
        _plotting_notebook(tmp_path / "plots.ipynb"), results_root=results, progress=False
    )
    executed = nbformat.read(run_dir / "notebook.ipynb", as_version=4)  # texts joined
    light, legacy = (  # papermill inserted a cell after the parameters
        next(c["outputs"] for c in executed["cells"] if marker in c["source"])
        for marker in ("use_notebook_renderer()", "plotly_mimetype+notebook")
    )
    assert len(light) == 2 and not any(is_plotly_js_bundle(o) for o in light)
    for output in light:  # plotly's mime type for JupyterLab, the light fallback for pages
        assert PLOTLY_MIME in output["data"]
        assert "Plotly.newPlot" in output["data"]["text/html"]
        assert not PLOTLY_JS_BANNER.search(output["data"]["text/html"])
    assert [is_plotly_js_bundle(o) for o in legacy] == [True, False]
    # the committed form drops the embedded bundle and nothing else
    committed = json.loads(jupyterlab_text(executed))
    outputs = [o for c in committed["cells"] for o in c.get("outputs", [])]
    assert [PLOTLY_MIME in o["data"] for o in outputs] == [True] * 3
    assert not PLOTLY_JS_BANNER.search(json.dumps(committed))

    page = export_html(run_dir / "notebook.ipynb", run_dir)
    html = page.read_text()
    assert page == run_dir.resolve() / "notebook.html"
    assert _plotly_scripts(html) == [f"../../{PLOTLY_JS}"]  # the results tree's one copy
    assert not PLOTLY_JS_BANNER.search(html)
    assert len(FIGURE_DIV.findall(html)) == 3
    assert (results / PLOTLY_JS).is_file() and not list(run_dir.glob("*.js"))
