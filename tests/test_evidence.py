"""Every published figure is backed by a committed evidence folder (the convention of
``kakeya_lab/evidence.py``): the checker on the real docs/results.md and README headline
table, and the checker itself caught failing on wrong numbers, missing quotes, missing
folders, unbacked sections and unbacked headline rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kakeya_lab.cli import main
from kakeya_lab.evidence import (
    check_evidence,
    headline_rows,
    headline_rows_without_evidence,
    load_claims,
    parse_numbers,
    sections_without_evidence,
)

ROOT = Path(__file__).resolve().parent.parent


def test_every_claim_in_evidence_holds_against_the_results_and_the_readme():
    problems = [p for p in check_evidence(ROOT) if "names no evidence folder" not in p]
    assert not problems, "\n".join(problems)


def test_every_results_section_names_an_evidence_folder():
    missing = sections_without_evidence((ROOT / "docs" / "results.md").read_text())
    assert not missing, f"results sections without evidence: {missing}"


def test_every_headline_row_names_an_evidence_folder():
    readme = (ROOT / "README.md").read_text()
    assert len(headline_rows(readme)) >= 5
    assert not headline_rows_without_evidence(readme)


def test_the_headline_table_is_checked_too():
    folders = sorted(p for p in (ROOT / "evidence").iterdir() if p.is_dir())
    claims = [c for folder in folders for c in load_claims(folder)]
    assert sum(c.doc == "README.md" for c in claims) >= 20


def test_numbers_are_parsed_with_their_decimals():
    assert parse_numbers("1.03×") == [(1.03, 2)]
    assert parse_numbers("11,796,480 bytes") == [(11796480.0, 0)]
    assert parse_numbers("**−20.9%**") == [(-20.9, 1)]
    assert parse_numbers("≤ 6.9e-5") == [(pytest.approx(6.9e-5), 6)]
    assert parse_numbers("turns 1,000, 0.25 s") == [(1000.0, 0), (0.25, 2)]


RESULTS = """# Results

## Is it fast?

### Speed (evidence: `evidence/speed/`)

The ratio was **1.03×** over 1,000 turns, at 11,796,480 bytes; drift −20.9%.
Median ratio 1.01 over 3 turns, 1 above 1.02 (33%); timings median 2.0 s.

### Not backed

A number 42 with no evidence.

## After
"""

README = """# x

## Headline results

| question | figure | evidence |
|---|---|---|
| fast? | ratio 1.03× | `evidence/speed/` |

## Tests
"""


def _repo(tmp_path, claims: str, results: str = RESULTS, readme: str = README) -> Path:
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text(results)
    folder = tmp_path / "evidence" / "speed"
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(
        json.dumps(
            {
                "r": {"ratio": 1.0312},
                "rows": [{"bytes": 11796480}],
                "drift": -0.2094,
                "timings": [1.0, 2.0, 10.0],
            }
        )
    )
    (folder / "turns.csv").write_text("turn,ratio\n0,1.0\n1,1.0299\n2,1.0131\n")
    (folder / "claims.yaml").write_text(claims)
    return tmp_path


GOOD = """\
- {quote: "**1.03×**", file: metrics.json, key: r.ratio}
- {quote: "1.03×", file: turns.csv, key: "1.ratio"}
- {quote: "at 11,796,480 bytes", file: metrics.json, key: rows.0.bytes}
- {quote: "drift −20.9%", file: metrics.json, key: drift, scale: 100}
- {quote: "1.03×** over 1,000", file: metrics.json, key: r.ratio, index: 0}
- {quote: "ratio 1.03×", file: metrics.json, key: r.ratio, doc: README.md}
- {quote: "Median ratio 1.01 over 3", file: turns.csv, key: ratio, reduce: median, index: 0}
- {quote: "Median ratio 1.01 over 3", file: turns.csv, key: ratio, reduce: count, index: 1}
- {quote: "1 above 1.02", file: turns.csv, key: ratio, reduce: count, where: {ratio: ">1.02"},
   index: 0}
- {quote: "1.02 (33%)", file: turns.csv, key: ratio, reduce: fraction, matching: {ratio: ">1.02"},
   scale: 100, index: 1}
- {quote: "timings median 2.0 s", file: metrics.json, key: timings, reduce: median}
"""


def test_the_checker_accepts_true_claims_and_reports_unbacked_sections(tmp_path, capsys):
    root = _repo(tmp_path, GOOD)
    assert check_evidence(root) == ["docs/results.md section 'Not backed' names no evidence folder"]
    assert main(["evidence", "check", str(root)]) == 1
    assert "'Not backed'" in capsys.readouterr().out
    (root / "docs" / "results.md").write_text(
        RESULTS.replace("### Not backed", "### Backed evidence/speed")
    )
    assert check_evidence(root) == []
    assert main(["evidence", "check", str(root)]) == 0


@pytest.mark.parametrize(
    "claims, said",
    [
        ('- {quote: "1.04×", file: metrics.json, key: r.ratio}', "not in docs/results.md"),
        ('- {quote: "**1.03×**", file: metrics.json, key: drift}', "does not round to"),
        ('- {quote: "drift −20.9%", file: metrics.json, key: drift}', "does not round to"),
        ('- {quote: "1.03×", file: metrics.json, key: r.nope}', "KeyError"),
        ('- {quote: "1.03×", file: gone.json, key: r.ratio}', "FileNotFoundError"),
        ('- {quote: "1.03×** over 1,000", file: metrics.json, key: r.ratio}', "2 numbers"),
        ('- {quote: "1.03×", file: metrics.json}', "needs quote, file and key"),
        # a README claim is checked against the README, not the results page
        (
            '- {quote: "**1.03×**", file: metrics.json, key: r.ratio, doc: README.md}',
            "not in README.md",
        ),
        (
            '- {quote: "ratio 1.03×", file: metrics.json, key: drift, doc: README.md}',
            "does not round to",
        ),
        (
            '- {quote: "1.03×", file: metrics.json, key: r.ratio, doc: NOTES.md}',
            "doc must be one of",
        ),
        # figures derived from several values: wrong ones, and malformed derivations
        (
            '- {quote: "1 above 1.02", file: turns.csv, key: ratio, reduce: count, '
            'where: {ratio: ">=1.0"}, index: 0}',
            "does not round to",
        ),
        (
            '- {quote: "ratio 1.01", file: turns.csv, key: ratio, reduce: median, '
            "where: {turn: 1}}",
            "does not round to",
        ),
        ('- {quote: "median 2.0 s", file: metrics.json, key: timings, reduce: mean}', "round to"),
        ('- {quote: "median 2.0 s", file: metrics.json, key: timings, reduce: mode}', "one of"),
        ('- {quote: "ratio 1.01", file: turns.csv, key: ratio, where: {turn: 1}}', "need reduce"),
        (
            '- {quote: "ratio 1.01", file: turns.csv, key: ratio, reduce: median, '
            "matching: {turn: 1}}",
            "matching goes with reduce: fraction",
        ),
        (
            '- {quote: "ratio 1.01", file: turns.csv, key: ratio, reduce: median, '
            "where: {turn: 7}}",
            "nothing to reduce",
        ),
        (
            '- {quote: "ratio 1.01", file: turns.csv, key: ratio, reduce: median, '
            "where: {speed: 1}}",
            "no column 'speed'",
        ),
        (
            '- {quote: "median 2.0 s", file: metrics.json, key: timings, reduce: median, '
            "where: {turn: 1}}",
            "select CSV rows",
        ),
        ('- {quote: "median 2.0 s", file: metrics.json, key: drift, reduce: max}', "not a list"),
        (
            '- {quote: "ratio 1.01", file: turns.csv, key: ratio, reduce: median, where: turn}',
            "where must map columns to values",
        ),
        # a headline row whose figure no README claim quotes
        ('- {quote: "**1.03×**", file: metrics.json, key: r.ratio}', "quotes no claimed figure"),
    ],
)
def test_the_checker_catches_false_claims(tmp_path, claims, said):
    problems = check_evidence(_repo(tmp_path, claims))
    assert any(said in p for p in problems), problems


def test_the_checker_catches_missing_folders_and_unnamed_ones(tmp_path):
    root = _repo(tmp_path, GOOD, RESULTS.replace("evidence/speed/", "evidence/sped/"))
    problems = check_evidence(root)
    assert any("evidence/sped/, which does not exist" in p for p in problems), problems
    assert any("evidence/speed is not named in docs/results.md" in p for p in problems), problems


def test_the_checker_catches_unbacked_headline_rows_and_a_missing_table(tmp_path):
    root = _repo(tmp_path, GOOD, readme=README.replace("`evidence/speed/`", "-"))
    assert any("headline row names no evidence folder" in p for p in check_evidence(root))
    (root / "README.md").write_text("# x\n\n## Tests\n")
    assert any("no table under '## Headline results'" in p for p in check_evidence(root))
    (root / "docs" / "results.md").unlink()
    assert "docs/results.md is missing" in check_evidence(root)
