"""Self-describing result files (``docs/design.md``, "Results"), written atomically.

A ``metrics.json`` is ``run_header(...)`` plus ``ended``, ``headline`` and ``metrics``; it
must validate against ``kakeya_lab/schemas/metrics.schema.json`` (:data:`METRICS_SCHEMA`),
which :func:`write_metrics` checks before anything is written. :func:`run_header` refuses a
model description without a name and a weight sha256, so a run folder always says which
weights produced it.

Figures are standalone HTML that load plotly.js from one shared ``plotly.min.js`` at the
root of the results tree (:func:`save_figure`), not a 4.8 MB copy per run folder.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from kakeya_lab.durable import finite, write_csv_atomic, write_json_atomic, write_text_atomic

SCHEMA_VERSION = 1
PLOTLY_JS = "plotly.min.js"
RESULTS_MARKER = ".kakeya-results"  # marks the root of a results tree (where plotly.min.js lives)
_PACKAGES = ("kakeya_lab", "torch", "transformers", "numpy", "pandas", "plotly", "papermill")
_MODEL_FIELDS = ("name", "weight_sha256", "architecture", "random")

__all__ = [
    "METRICS_SCHEMA",
    "SCHEMA_VERSION",
    "ResultSchemaError",
    "git_commit",
    "ensure_plotlyjs",
    "hardware",
    "mark_results_root",
    "now_iso",
    "package_versions",
    "results_root_of",
    "run_header",
    "save_figure",
    "validate_metrics",
    "write_json_atomic",
    "write_metrics",
    "write_run",
]


class ResultSchemaError(ValueError):
    """A result document that does not say what it is (fails ``metrics.schema.json``)."""


@lru_cache(maxsize=1)
def _schema() -> dict:
    text = resources.files("kakeya_lab").joinpath("schemas/metrics.schema.json").read_text()
    return json.loads(text)


METRICS_SCHEMA: dict = _schema()


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_commit(path: str | Path = ".") -> str | None:
    """The commit of the checkout holding ``path`` (``-dirty`` if it has changes)."""
    try:
        root = Path(path).resolve()
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_identity() -> dict[str, Any]:
    """The CPU's model name and flags (Linux ``/proc/cpuinfo``; elsewhere the platform's
    processor string and no flags)."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name":
                name = value.strip()
            elif field.strip() == "flags":
                flags = value.strip()
            if field.strip() == "" and flags:  # the first processor's block is enough
                break
    except OSError:
        pass
    return {"cpu": name, "cpu_flags": sorted(flags.split())}


def hardware() -> dict[str, Any]:
    """CPU (model name and flags; and GPU, when torch sees one) of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_flags": cpu_identity()["cpu_flags"],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        info["gpu"] = None
    return info


def _model_record(model: Any) -> dict[str, Any]:
    """The identity of ``model`` (a ModelDescription or a dict); refuses an anonymous one."""
    if model is None:
        raise ResultSchemaError(
            "run_header needs model=: the ModelDescription of the loaded model (loaded.description)"
        )
    if isinstance(model, dict):
        record = {k: model.get(k) for k in _MODEL_FIELDS}
    elif all(hasattr(model, k) for k in ("name", "weight_sha256")):
        record = {k: getattr(model, k, None) for k in _MODEL_FIELDS}
    else:
        raise ResultSchemaError(
            f"run_header: model must be a ModelDescription or a dict with name and weight_sha256, "
            f"got {type(model).__name__}"
        )
    missing = [
        k for k in ("name", "weight_sha256") if not isinstance(record[k], str) or not record[k]
    ]
    if missing:
        raise ResultSchemaError(
            f"run_header: the model description has no {' or '.join(missing)} (got keys "
            f"{sorted(model) if isinstance(model, dict) else type(model).__name__}); pass "
            "loaded.description so the run folder names the weights that produced it"
        )
    if not isinstance(record["random"], bool):
        raise ResultSchemaError(
            f"run_header: the model description must say random=True/False (got {record['random']!r}), "
            "so a randomly initialised model is never read as a real one"
        )
    return record


def run_header(
    *,
    experiment: str,
    run_id: str,
    model: Any,
    backend: str | None = None,
    dtype: str = "float32",
    cache: dict | None = None,
    proposer: dict | str | None = None,
    seed: int | None = None,
    started: str | None = None,
    extra: dict | None = None,
) -> dict[str, Any]:
    """The header every result file starts with.

    ``model``: the ModelDescription of the loaded model (or a dict with at least ``name``
    and ``weight_sha256``); anything else raises :class:`ResultSchemaError`. ``cache``: a
    ``SinkWindowConfig.to_dict()`` (``sink``, ``window``, ``positions``). ``extra`` keys are
    added at the top level and may not overwrite a header field. ``backend``: default the
    model description's ``backend`` (``"torch"`` if it has none).
    """
    cache = cache or {}
    if backend is None:
        named = model.get("backend") if isinstance(model, dict) else getattr(model, "backend", None)
        backend = named if isinstance(named, str) else "torch"
    header = {
        "schema_version": SCHEMA_VERSION,
        "experiment": experiment,
        "run_id": run_id,
        "model": _model_record(model),
        "backend": backend,
        "dtype": dtype,
        "sink": cache.get("sink"),
        "window": cache.get("window"),
        "positions": cache.get("positions"),
        "proposer": proposer,
        "seed": seed,
        "git_commit": git_commit(Path(__file__).parent),
        "packages": package_versions(),
        "hardware": hardware(),
        "started": started or now_iso(),
        "ended": None,
    }
    if extra:
        clash = sorted(set(extra) & set(header))
        if clash:
            raise ResultSchemaError(f"run_header: extra keys {clash} would overwrite header fields")
        header.update(extra)
    return header


def _where(error: Any) -> str:
    path = "/".join(str(p) for p in error.absolute_path)
    return path or "(top level)"


@lru_cache(maxsize=1)
def _compiled_schema() -> Any:
    """The schema compiled by fastjsonschema, its ``date-time`` checked by the function
    jsonschema uses (fastjsonschema's own pattern passes a ``+0000`` offset and second 60)."""
    import fastjsonschema
    from rfc3339_validator import validate_rfc3339

    return fastjsonschema.compile(
        METRICS_SCHEMA, formats={"date-time": lambda value: validate_rfc3339(value.upper())}
    )


def validate_metrics(doc: dict) -> None:
    """Raise :class:`ResultSchemaError` naming every bad field if ``doc`` does not match
    ``metrics.schema.json``.

    A document is first checked by a validator compiled from the schema (fastjsonschema,
    which stops at the first error); only one that fails it is checked again by jsonschema,
    to name every bad field. Importing jsonschema takes seconds (its IRI format checker
    builds a set of grammars on import), once in every process that writes a run folder."""
    import fastjsonschema

    try:
        _compiled_schema()(doc)
        return
    except fastjsonschema.JsonSchemaException as exc:
        first = str(exc)
    import jsonschema

    validator = jsonschema.Draft202012Validator(
        METRICS_SCHEMA, format_checker=jsonschema.FormatChecker()
    )
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        detail = "; ".join(f"{_where(e)}: {e.message}" for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ResultSchemaError(f"metrics.json does not match its schema: {detail}{more}")
    raise ResultSchemaError(f"metrics.json does not match its schema: {first}")


def write_metrics(
    run_dir: str | Path,
    header: dict,
    metrics: dict,
    *,
    headline: dict | None = None,
    name: str = "metrics.json",
) -> Path:
    """Write ``{**header, "ended": now, "headline": ..., "metrics": metrics}`` atomically,
    after checking it against the schema (nothing is written if it does not match).

    ``headline``: the few numbers the run index (``results/index.parquet``) shows.
    """
    doc = dict(header)
    doc["ended"] = now_iso()
    doc["headline"] = headline or {}
    doc["metrics"] = metrics
    doc = finite(doc)
    validate_metrics(json.loads(json.dumps(doc, default=_plain)))
    return write_json_atomic(Path(run_dir) / name, doc)


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def mark_results_root(results_root: str | Path) -> Path:
    """Mark ``results_root`` as the root of a results tree: figures in run folders below
    it share its ``plotly.min.js``."""
    root = Path(results_root)
    root.mkdir(parents=True, exist_ok=True)
    marker = root / RESULTS_MARKER
    if not marker.exists():
        write_text_atomic(marker, "kakeya_lab results tree: run folders share ./plotly.min.js\n")
    return root


def results_root_of(run_dir: Path) -> Path:
    """The results tree ``run_dir`` lies in (the nearest folder with the marker, see
    :func:`mark_results_root`), or ``run_dir`` itself outside any tree."""
    for folder in (run_dir, *run_dir.parents):
        if (folder / RESULTS_MARKER).exists():
            return folder
    return run_dir


def ensure_plotlyjs(root: Path) -> Path:
    """Write the installed plotly.js as ``root/plotly.min.js`` unless it is already there,
    unchanged; return its path (the one copy pages and figures under ``root`` load)."""
    from plotly.offline import get_plotlyjs

    path = root / PLOTLY_JS
    script = get_plotlyjs()
    if (
        not path.is_file()
        or path.stat().st_size != len(script.encode())
        or path.read_text() != script
    ):
        write_text_atomic(path, script)
    return path


def save_figure(fig: Any, run_dir: str | Path, name: str) -> Path:
    """Save a plotly figure as ``<run_dir>/<name>.html``, offline, atomically.

    plotly.js is written once per results tree (``plotly.min.js`` beside the
    ``.kakeya-results`` marker above ``run_dir``, see :func:`mark_results_root`; in
    ``run_dir`` itself when there is no marker) and referenced by a relative path.
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    script = ensure_plotlyjs(results_root_of(run_dir))
    src = os.path.relpath(script, run_dir).replace(os.sep, "/")
    html = fig.to_html(include_plotlyjs=src, full_html=True)
    return write_text_atomic(run_dir / f"{name}.html", html)


def write_run(
    run_dir: str | Path,
    header: dict,
    metrics: dict,
    *,
    headline: dict | None = None,
    tables: dict[str, Any] | None = None,
    figures: dict[str, Any] | None = None,
) -> Path:
    """The result files of one run folder, as every family's ``save_*`` writes them:
    ``metrics.json`` (:func:`write_metrics`), each of ``tables`` (pandas DataFrames) as
    ``NAME.csv`` and each of ``figures`` (plotly figures) as ``NAME.html``
    (:func:`save_figure`). Returns the path of ``metrics.json``."""
    out = Path(run_dir)
    path = write_metrics(out, header, metrics, headline=headline)
    for name, table in (tables or {}).items():
        write_csv_atomic(out / f"{name}.csv", table)
    for name, fig in (figures or {}).items():
        save_figure(fig, out, name)
    return path


def _verdict(value: Any) -> str:
    return {True: "yes", False: "NO"}.get(value, "not measured")


def summary_lines(run_dir: str | Path) -> list[str]:
    """A few lines a person reads at the end of a run: per arm the headline verdicts (KV
    bounded; prefill bounded, the reference gate, with its thresholds; prefill flat vs
    history, the stricter slope test, when the run has it) with the turn latency p50 / p95 when ``metrics.json`` has
    them, then where the figures are. Empty when the run folder has no ``metrics.json``
    (e.g. an interactive demo notebook)."""
    folder = Path(run_dir)
    path = folder / "metrics.json"
    if not path.is_file():
        return []
    doc = json.loads(path.read_text())
    arms = (doc.get("metrics") or {}).get("arms") or {}
    lines = []
    for arm, headline in (doc.get("headline") or {}).items():
        if not isinstance(headline, dict) or "kv_bounded" not in headline:
            continue
        summary = arms.get(arm) or {}
        latency = ((summary.get("latency") or {}).get("turn_latency_s")) or {}
        timing = (
            f"; turn latency p50 {latency['p50']:.2f} s, p95 {latency['p95']:.2f} s"
            if latency.get("p50") is not None and latency.get("p95") is not None
            else ""
        )
        prefill = headline.get("prefill_bounded", summary.get("prefill_bounded"))
        flat = headline.get("prefill_flat_vs_history", summary.get("prefill_flat_vs_history"))
        gates = summary.get("gates") or headline.get("prefill_gates") or {}
        ref = gates.get("prefill_bounded") or {}
        thresholds = (
            f" (last vs first bucket p50, tolerance {ref['tolerance']:.0%}, {ref['direction']})"
            if "tolerance" in ref and "direction" in ref
            else ""
        )
        strict = f", prefill flat vs history {_verdict(flat)}" if flat is not None else ""
        lines.append(
            f"{arm}: KV bounded {_verdict(headline['kv_bounded'])}, "
            f"prefill bounded {_verdict(prefill)}{thresholds}{strict}{timing}"
        )
    figures = sorted(p.name for p in folder.glob("*.html"))
    if figures:
        lines.append(f"figures in {folder}: {', '.join(figures)}")
    return lines
