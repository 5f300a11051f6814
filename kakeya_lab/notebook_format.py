"""Notebooks stored byte for byte as JupyterLab 4 saves them, so open-and-save leaves git clean.

JupyterLab round-trips a notebook through the browser: JSON numbers pass through JavaScript,
where an integral float (``12.0``) becomes ``12``; the server then writes it back with
nbformat (``indent=1``, sorted keys, non-ASCII kept, a trailing newline). Papermill and
nbclient write integral floats as ``12.0`` and no trailing newline, so a freshly executed
notebook differs from its saved self. :func:`jupyterlab_text` gives the saved form, and
every committed notebook names the project's kernel (:data:`KERNEL_NAME`), whose display
name JupyterLab would otherwise rewrite. Widget state that nbclient saves in the metadata is
dropped: it is a frozen snapshot no static view can use (JupyterLab leaves it absent). So is
an output that only embeds the plotly.js bundle (what plotly's ``notebook`` renderer emits
before its first figure, 4.7 MB): figures carry plotly's mime type plus a light HTML
fallback (:func:`kakeya_lab.plots.use_notebook_renderer`), and the HTML export adds
plotly.js once per page (:mod:`kakeya_lab.notebook_html`).

``python -m kakeya_lab.notebook_format notebooks/*.ipynb`` rewrites notebooks in place;
``--check`` only reports the ones that differ (exit code 1).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import nbformat
from nbformat.v4.rwbase import rejoin_lines

KERNEL_NAME = "kakeya_lab"
KERNELSPEC = {"display_name": KERNEL_NAME, "language": "python", "name": KERNEL_NAME}
_JS_EXPONENT_FROM = 1e21  # JavaScript prints integral numbers below this without an exponent
PLOTLY_MIME = "application/vnd.plotly.v1+json"
_PLOTLY_JS_BUNDLE = re.compile(r"<script>/\*\*\s*\*\s*plotly\.js v\d")  # the bundle's banner


def _as_javascript_number(value: Any) -> Any:
    """What ``JSON.parse`` then ``JSON.stringify`` in the browser make of a JSON value."""
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < _JS_EXPONENT_FROM:
            return int(value)
        return value
    if isinstance(value, dict):
        return {key: _as_javascript_number(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_javascript_number(item) for item in value]
    return value


def is_plotly_js_bundle(output: dict) -> bool:
    """Whether a notebook output only embeds the plotly.js bundle (no figure of its own)."""
    data = output.get("data", {})
    html = data.get("text/html", "")
    html = "".join(html) if isinstance(html, list) else html
    return PLOTLY_MIME not in data and bool(_PLOTLY_JS_BUNDLE.search(html))


def drop_plotly_js_bundles(notebook: dict) -> int:
    """Remove the outputs that only embed plotly.js from ``notebook`` (in place); return
    how many there were."""
    dropped = 0
    for cell in notebook.get("cells", []):
        outputs = cell.get("outputs")
        if outputs:
            kept = [output for output in outputs if not is_plotly_js_bundle(output)]
            dropped += len(outputs) - len(kept)
            cell["outputs"] = kept
    return dropped


def jupyterlab_text(notebook: dict | nbformat.NotebookNode, *, set_kernel: bool = True) -> str:
    """The exact text JupyterLab 4 writes for ``notebook`` (after a browser round trip).

    ``set_kernel`` names the project's kernel in the metadata and drops saved widget state
    and embedded plotly.js bundles (what a committed notebook must carry).
    """
    data = _as_javascript_number(json.loads(json.dumps(notebook)))
    if set_kernel:
        data.setdefault("metadata", {})["kernelspec"] = dict(KERNELSPEC)
        data["metadata"].pop("widgets", None)
        drop_plotly_js_bundles(data)
    # the browser holds each text as one string: the save splits it again, so a stored list
    # with another split (a trailing "" after a final newline) comes back changed
    node = rejoin_lines(nbformat.from_dict(data))
    text = nbformat.writes(node, version=nbformat.NO_CONVERT)
    return text if text.endswith("\n") else text + "\n"


def normalize(path: str | Path, *, check: bool = False) -> bool:
    """Rewrite ``path`` in JupyterLab's form; return whether it was (or, with ``check``,
    would be) changed."""
    path = Path(path)
    current = path.read_text(encoding="utf-8")
    wanted = jupyterlab_text(json.loads(current))
    if wanted == current:
        return False
    if not check:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(wanted, encoding="utf-8")
        tmp.replace(path)
    return True


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    paths = [a for a in args if a != "--check"]
    if not paths:
        print("usage: python -m kakeya_lab.notebook_format [--check] NOTEBOOK.ipynb ...")
        return 2
    changed = [p for p in paths if normalize(p, check=check)]
    for p in changed:
        print(("not in JupyterLab's form: " if check else "rewrote ") + p)
    return 1 if check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
