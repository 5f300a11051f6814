"""Notebooks as offline HTML pages (``make html``), with plotly.js once per page.

Committed and executed notebooks carry each figure as plotly's mime type (JupyterLab draws
it) plus a light HTML fallback: the figure's div and the ``Plotly.newPlot`` call that draws
it, without plotly.js (:func:`kakeya_lab.plots.use_notebook_renderer`). An exported page is
nbconvert's ``lab`` page plus one ``<script src>`` in its head that loads ``plotly.min.js``
from a local file, so every figure draws with the network off (no CDN). That file is
written once per folder tree: beside the pages, or, for a page written into a run folder,
at the root of its results tree (the copy the run folders' figures already share, see
:func:`kakeya_lab.results.save_figure`). Pages without a figure load no plotly.js.

``python -m kakeya_lab.notebook_html [--out build/html] NOTEBOOK.ipynb ...`` writes
``<out>/<notebook stem>.html`` for each notebook.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from kakeya_lab.durable import write_text_atomic
from kakeya_lab.notebook_format import PLOTLY_MIME, drop_plotly_js_bundles
from kakeya_lab.results import ensure_plotlyjs, results_root_of

DEFAULT_OUT_DIR = Path("build/html")
_TEMPLATE_NAME = "kakeya_lab_page.html.j2"
# nbconvert's lab page, plus plotly.js (and plotly's page config) in the head, before any
# figure's script runs.
_TEMPLATE = """\
{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}
{{ super() }}
{%- if resources.plotly_js_src %}
<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>
<script src="{{ resources.plotly_js_src }}"></script>
{%- endif %}
{%- endblock html_head_js -%}
"""


def has_plotly_figures(notebook: dict) -> bool:
    """Whether any output of ``notebook`` is a plotly figure."""
    return any(
        PLOTLY_MIME in output.get("data", {})
        for cell in notebook.get("cells", [])
        for output in cell.get("outputs", [])
    )


@lru_cache(maxsize=1)
def _exporter() -> Any:
    import jinja2
    from nbconvert import HTMLExporter

    return HTMLExporter(
        template_name="lab",
        template_file=_TEMPLATE_NAME,
        extra_loaders=[jinja2.DictLoader({_TEMPLATE_NAME: _TEMPLATE})],
    )


def export_html(notebook: str | Path, out_dir: str | Path = DEFAULT_OUT_DIR) -> Path:
    """Write ``notebook`` as ``<out_dir>/<stem>.html``, figures drawn offline; return the path.

    The page loads plotly.js from ``plotly.min.js`` at the root of the results tree that
    ``out_dir`` lies in, or in ``out_dir`` itself (written there if missing or stale). A
    plotly.js bundle embedded in an older notebook's outputs is left out, so a page never
    carries two.
    """
    import nbformat

    notebook = Path(notebook)
    if not notebook.is_file():
        raise FileNotFoundError(f"no notebook at {notebook}")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    node = nbformat.reads(notebook.read_text(encoding="utf-8"), as_version=4)
    drop_plotly_js_bundles(node)
    resources: dict[str, Any] = {"metadata": {"name": notebook.stem}}
    if has_plotly_figures(node):
        script = ensure_plotlyjs(results_root_of(out_dir))
        resources["plotly_js_src"] = os.path.relpath(script, out_dir).replace(os.sep, "/")
    body, _ = _exporter().from_notebook_node(node, resources=resources)
    return write_text_atomic(out_dir / f"{notebook.stem}.html", body)


def main(argv: list[str] | None = None) -> int:
    """Export the notebooks named on the command line; exit code 0, or 2 on bad usage."""
    parser = argparse.ArgumentParser(
        prog="python -m kakeya_lab.notebook_html",
        description="Export notebooks as offline HTML pages sharing one plotly.min.js.",
    )
    parser.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK.ipynb")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT_DIR, help="folder for the pages (build/html)"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    for notebook in args.notebooks:
        print(f"wrote {export_html(notebook, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
