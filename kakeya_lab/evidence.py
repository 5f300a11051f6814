"""The evidence convention, checked: every published figure backed by a committed file.

Figures live in two documents (:data:`DOCUMENTS`): ``docs/results.md``, the complete
record, and the headline table of ``README.md``. ``evidence/<name>/`` holds a run's small
files (``metrics.json``, ``turns.csv``, ``command.txt``) and ``claims.yaml``, a list of
``{quote: "1.03×", file: metrics.json, key: "anchor.ratio", scale: 1, doc: README.md}``:
the document ``doc`` (default ``docs/results.md``) contains ``quote``; the number in the
quote (``index``: which one, when the quote holds several; default the only one) equals
``value(file, key) * scale`` rounded to the decimals the quote writes (``6.9e-5``: to its
significant digits). ``key`` is a dotted path into a JSON file, or into a CSV file read as
a list of rows (``"23.cache_len"``).

A figure derived from several values is claimed with ``reduce`` (:data:`REDUCTIONS`). In a
JSON file ``key`` then names a list of numbers. In a CSV file ``key`` is a column, ``where``
(``{arm: "suffix@8", proposed: ">0"}``) selects the rows (a value equal to the cell, or
compared with ``>``, ``>=``, ``<``, ``<=``, ``!=``), and the reduction runs over them:
``median``, ``mean``, ``sum``, ``min``, ``max`` of the column, ``count`` of the rows, or
``fraction``: the share of the selected rows that also match ``matching``. ``{quote: "44 of
56", file: steps_code.csv, key: accepted, reduce: count, where: {arm: "suffix@8", proposed:
8, accepted: 8}, index: 0}`` says that 44 steps of ``suffix@8`` proposed 8 drafts and had
all 8 accepted.

:func:`check_evidence` also checks that every ``evidence/...`` path either document names
exists, that every evidence folder is named in ``docs/results.md``, that evidence files
stay small, that every ``###`` section of ``docs/results.md`` names an evidence folder
(:func:`sections_without_evidence`) and that every row of the README's headline table
does (:func:`headline_rows_without_evidence`) and quotes a figure claimed with
``doc: README.md``. ``kakeya-lab evidence check`` prints the problems.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 1_000_000
RESULTS = "docs/results.md"
README = "README.md"
DOCUMENTS = (RESULTS, README)
HEADLINE = "Headline results"
_NUMBER = re.compile(r"[-−]?\d[\d,]*(?:\.\d+)?(?:[eE][-−]?\d+)?")
_EVIDENCE_PATH = re.compile(r"evidence/[A-Za-z0-9_.\-/]*[A-Za-z0-9_/]")
REDUCTIONS = ("median", "mean", "sum", "min", "max", "count", "fraction")
_COMPARISONS = {
    ">=": float.__ge__,
    "<=": float.__le__,
    "!=": float.__ne__,
    ">": float.__gt__,
    "<": float.__lt__,
}


@dataclass(frozen=True)
class Claim:
    """One entry of a ``claims.yaml``."""

    folder: Path
    quote: str
    file: str
    key: str
    scale: float = 1.0
    index: int | None = None
    doc: str = RESULTS
    reduce: str | None = None
    where: dict[str, str] | None = None
    matching: dict[str, str] | None = None


def parse_numbers(quote: str) -> list[tuple[float, int]]:
    """Every number written in ``quote`` with its decimals (thousands commas, unicode
    minus; a unit such as ``%``, ``×``, ``x``, ``s`` after it is ignored). For ``6.9e-5``
    the decimals are those of the value (here 6: it is written to 1e-6)."""
    out = []
    for match in _NUMBER.finditer(quote):
        text = match.group().replace("−", "-").rstrip(",")
        mantissa, _, exponent = text.lower().partition("e")
        mantissa = mantissa.replace(",", "")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        if exponent:
            decimals -= int(exponent)
        out.append((float(mantissa) * 10 ** int(exponent or 0), decimals))
    return out


def quoted_number(claim: Claim) -> tuple[float, int]:
    """The number a claim's quote states, with its decimals (ValueError if ambiguous)."""
    numbers = parse_numbers(claim.quote)
    if claim.index is not None:
        if not 0 <= claim.index < len(numbers):
            raise ValueError(f"quote {claim.quote!r} has no number #{claim.index}")
        return numbers[claim.index]
    if len(numbers) != 1:
        raise ValueError(
            f"quote {claim.quote!r} holds {len(numbers)} numbers: add `index:` (0-based) to say which"
        )
    return numbers[0]


def _load(path: Path) -> Any:
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    return json.loads(path.read_text())


def value_at(doc: Any, key: str) -> Any:
    """``doc`` followed along the dotted ``key`` (numbers index lists)."""
    node = doc
    for part in key.split("."):
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(f"no {part!r} on the way to {key!r}")
    return node


def _matches(row: dict[str, str], where: dict[str, str]) -> bool:
    """Whether a CSV row meets every condition of ``where`` (module docstring)."""
    for column, wanted in where.items():
        if column not in row:
            raise KeyError(f"no column {column!r}")
        cell = row[column]
        for op, compare in _COMPARISONS.items():
            if wanted.startswith(op):
                if not compare(float(cell), float(wanted[len(op) :])):
                    return False
                break
        else:
            if cell != wanted and not _same_number(cell, wanted):
                return False
    return True


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def reduced_value(claim: Claim, loaded: Any) -> float:
    """The figure ``claim.reduce`` derives from ``loaded``, the claim's file as read
    (module docstring); a ValueError when nothing is selected."""
    if not claim.file.endswith(".csv"):
        if claim.where is not None or claim.matching is not None:
            raise ValueError("where and matching select CSV rows; this is not a CSV file")
        values = value_at(loaded, claim.key)
        if not isinstance(values, list):
            raise ValueError(f"{claim.key} is not a list, so there is nothing to reduce")
        return _reduce(claim.reduce, [float(v) for v in values], claim.key)
    selected = [r for r in loaded if _matches(r, claim.where or {})]
    if claim.reduce == "count":
        return float(len(selected))
    if claim.reduce == "fraction":
        if not selected:
            raise ValueError(f"no row of {claim.file} matches {claim.where}")
        return sum(_matches(r, claim.matching or {}) for r in selected) / len(selected)
    return _reduce(claim.reduce, [float(r[claim.key]) for r in selected], str(claim.where))


def _reduce(reduce: str | None, values: list[float], what: str) -> float:
    if reduce == "count":
        return float(len(values))
    if not values:
        raise ValueError(f"nothing to reduce: no values at {what}")
    values = sorted(values)
    if reduce == "median":
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
    if reduce == "mean":
        return sum(values) / len(values)
    if reduce == "sum":
        return sum(values)
    return values[0] if reduce == "min" else values[-1]


def _conditions(entry: dict, name: str, at: str) -> dict[str, str] | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{at}: {name} must map columns to values")
    return {str(k): str(v) for k, v in value.items()}


def load_claims(folder: str | Path) -> list[Claim]:
    """The claims of ``folder/claims.yaml`` (ValueError for a malformed entry)."""
    import yaml

    folder = Path(folder)
    entries = yaml.safe_load((folder / "claims.yaml").read_text()) or []
    if not isinstance(entries, list):
        raise ValueError(f"{folder}/claims.yaml must be a list of claims")
    claims = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not {"quote", "file", "key"} <= set(entry):
            raise ValueError(f"{folder}/claims.yaml entry {i} needs quote, file and key")
        at = f"{folder}/claims.yaml entry {i}"
        doc = str(entry.get("doc", RESULTS))
        if doc not in DOCUMENTS:
            raise ValueError(f"{at}: doc must be one of {DOCUMENTS}")
        reduce = entry.get("reduce")
        if reduce is not None and reduce not in REDUCTIONS:
            raise ValueError(f"{at}: reduce must be one of {REDUCTIONS}")
        if reduce is None and ("where" in entry or "matching" in entry):
            raise ValueError(f"{at}: where and matching need reduce")
        if (reduce == "fraction") != ("matching" in entry):
            raise ValueError(f"{at}: matching goes with reduce: fraction, and only there")
        claims.append(
            Claim(
                folder,
                str(entry["quote"]),
                str(entry["file"]),
                str(entry["key"]),
                float(entry.get("scale", 1)),
                entry.get("index"),
                doc,
                reduce,
                _conditions(entry, "where", at),
                _conditions(entry, "matching", at),
            )
        )
    return claims


def check_claim(claim: Claim, text: str) -> str | None:
    """None if the claim holds against ``text`` (the contents of ``claim.doc``), else what
    is wrong."""
    where = f"{claim.folder.name}: {claim.quote!r}"
    if claim.quote not in text:
        return f"{where}: the quote is not in {claim.doc}"
    try:
        number, decimals = quoted_number(claim)
        loaded = _load(claim.folder / claim.file)
        raw = value_at(loaded, claim.key) if claim.reduce is None else reduced_value(claim, loaded)
        value = float(raw) * claim.scale
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{where}: {claim.file}:{claim.key}: {type(exc).__name__}: {exc}"
    tolerance = 0.5 * 10.0**-decimals * (1 + 1e-9) + 1e-12 * abs(value)
    if abs(value - number) > tolerance:
        return (
            f"{where}: {claim.file}:{claim.key} is {raw!r} (x{claim.scale:g} = {value!r}), "
            f"which does not round to {number!r}"
        )
    return None


def results_subsections(results: str) -> dict[str, str]:
    """The ``###`` sections of the results page, under whichever ``##`` question: title ->
    text."""
    out: dict[str, str] = {}
    title = None
    for line in results.splitlines():
        if line.startswith("### "):
            title = line[4:].strip()
            out[title] = ""
        elif line.startswith("#"):
            title = None
        elif title is not None:
            out[title] += line + "\n"
    return out


def sections_without_evidence(results: str) -> list[str]:
    """Titles of the results page's ``###`` sections that name no ``evidence/<name>``
    folder."""
    return [
        title
        for title, text in results_subsections(results).items()
        if not _EVIDENCE_PATH.search(title + "\n" + text)
    ]


def headline_rows(readme: str) -> list[str]:
    """The body rows of the first table in the README's ``## Headline results`` section."""
    rows: list[str] = []
    in_section = False
    for line in readme.splitlines():
        if line.startswith("## "):
            if rows:
                break
            in_section = line[3:].strip().startswith(HEADLINE)
        elif in_section and line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows[2:]  # after the header and the rule


def headline_rows_without_evidence(readme: str) -> list[str]:
    """Rows of the README's headline table that name no ``evidence/<name>`` folder."""
    return [row for row in headline_rows(readme) if not _EVIDENCE_PATH.search(row)]


def check_evidence(root: str | Path = ".") -> list[str]:
    """Every problem of the repository at ``root`` (README.md, docs/results.md,
    evidence/), as messages; a missing document is one of them."""
    root = Path(root)
    texts = {}
    for doc in DOCUMENTS:
        path = root / doc
        texts[doc] = path.read_text() if path.is_file() else ""
    problems = [f"{doc} is missing" for doc in DOCUMENTS if not (root / doc).is_file()]
    for doc, text in texts.items():
        for name in sorted(set(_EVIDENCE_PATH.findall(text))):
            if not (root / name).exists():
                problems.append(f"{doc} names {name}, which does not exist")
    evidence = root / "evidence"
    folders = sorted(p for p in evidence.iterdir() if p.is_dir()) if evidence.is_dir() else []
    readme_quotes: list[str] = []
    for folder in folders:
        if f"evidence/{folder.name}" not in texts[RESULTS]:
            problems.append(f"evidence/{folder.name} is not named in {RESULTS}")
        for path in folder.rglob("*"):
            if path.is_file() and path.stat().st_size > MAX_FILE_BYTES:
                problems.append(f"{path.relative_to(root)} is over {MAX_FILE_BYTES:,} bytes")
        if not (folder / "claims.yaml").is_file():
            problems.append(f"evidence/{folder.name} has no claims.yaml")
            continue
        try:
            claims = load_claims(folder)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if not claims:
            problems.append(f"evidence/{folder.name}/claims.yaml claims nothing")
        problems += [p for c in claims if (p := check_claim(c, texts[c.doc])) is not None]
        readme_quotes += [c.quote for c in claims if c.doc == README]
    problems += [
        f"{RESULTS} section {t!r} names no evidence folder"
        for t in sections_without_evidence(texts[RESULTS])
    ]
    if not headline_rows(texts[README]):
        problems.append(f"{README} has no table under '## {HEADLINE}'")
    problems += [
        f"{README} headline row names no evidence folder: {row}"
        for row in headline_rows_without_evidence(texts[README])
    ]
    problems += [
        f"{README} headline row quotes no claimed figure (add a claim with doc: {README}): {row}"
        for row in headline_rows(texts[README])
        if not any(quote in row for quote in readme_quotes)
    ]
    return problems
