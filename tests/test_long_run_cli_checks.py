"""``kakeya-lab long-run`` checks a resume against its run folder before the model loads: a
resume with other settings (the linear kernel included) or a damaged ``checkpoint.json`` is
one line on stderr, exit 2, neither the model nor torch ever imported (the refusal comes at
once), and every file of the folder as it was (a completed run stays ``completed``).

Real subprocesses on the default model, as a user runs them, watched for a model load
(``tests/cli_watch.py``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_watch import run_watched

ARGS = ["--arms", "sink_window", "--sink", "4", "--window", "12", "--turns", "2"]
ARGS += ["--max-new-tokens", "2", "--probe-every", "0", "--checkpoint-every", "1", "--quiet"]


def _cli(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[str], bool]:
    return run_watched(["long-run", str(out), *ARGS, *extra])


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def _edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.slow  # the default model through the CLI, then a subprocess per refused resume
def test_a_refused_resume_is_refused_before_the_model_loads_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    first, _, _ = _cli(out)
    assert first.returncode == 0, first.stderr
    checkpoint = out / "checkpoint.json"
    good = checkpoint.read_text()
    cases = [
        ("other settings", ["--max-new-tokens", "3"], None, "max_new_tokens: was 2, now 3"),
        ("another kernel", ["--linear", "onednn"], None, "model.linear: was 'aten', now 'onednn'"),
        ("truncated", [], lambda p: p.write_text(good[:200]), "is not valid JSON"),
        (
            "a wrong type",
            [],
            lambda p: _edit(p, lambda d: d.update(next_turn="2")),
            "next_turn is '2'",
        ),
        ("a key missing", [], lambda p: _edit(p, lambda d: d.pop("rows")), "it lacks rows"),
    ]
    for name, extra, damage, said in cases:
        checkpoint.write_text(good)
        if damage is not None:
            damage(checkpoint)
        before = _files(out)
        assert json.loads(before["run.json"])["status"] == "completed"
        proc, loaded, torch = _cli(out, *extra)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("kakeya-lab: error: "), (name, lines)
        assert said in lines[0] and "--force-new" in lines[0], (name, lines[0])
        assert loaded == [] and not torch and proc.stdout == "", (name, loaded, proc.stdout)
        assert _files(out) == before, name  # nothing written: run.json still says completed
    # control: the same command passes the check, loads the model and resumes (nothing left)
    checkpoint.write_text(good)
    again, loaded, _ = _cli(out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "transformers.models.llama.modeling_llama" in loaded  # the hook sees a model load
    assert json.loads((out / "run.json").read_text())["status"] == "completed"
