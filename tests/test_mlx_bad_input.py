"""Bad input on the MLX path: each case a clear error that says what to do.

The other two cases of the issue (an unsupported architecture names the supported ones; a
torch drafter with an MLX verifier) are in tests/test_mlx.py; here: MLX not installed, in a
real interpreter whose import path holds every installed package except mlx and mlx-lm.
"""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MLX_DISTRIBUTIONS = ("mlx", "mlx_lm", "mlx_cpu", "mlx_metal", "mlx-")


@pytest.fixture(scope="module")
def site_without_mlx(tmp_path_factory) -> Path:
    """A directory of symlinks to everything in this interpreter's site-packages except
    the mlx distributions (packages, dist-info, bundled libs)."""
    out = tmp_path_factory.mktemp("site-without-mlx")
    for root in site.getsitepackages():
        for entry in Path(root).iterdir():
            name = entry.name.lower()
            if name.startswith(MLX_DISTRIBUTIONS) or entry.suffix == ".pth":
                continue
            if not (out / entry.name).exists():
                (out / entry.name).symlink_to(entry)
    return out


def _run_without_mlx(site_dir: Path, code: str) -> subprocess.CompletedProcess:
    # -S: no site-packages of the interpreter; the path is this repo, then the mlx-less copy
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": f"{REPO}:{site_dir}", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # a subprocess that imports torch
def test_mlx_not_installed_names_the_extra(site_without_mlx):
    code = (
        "import importlib.util, kakeya_lab\n"
        "assert importlib.util.find_spec('mlx') is None, 'mlx is still importable'\n"
        "from kakeya_lab.models import DEFAULT_MODEL, ModelStoreError, load_model\n"
        "try:\n"
        "    load_model(DEFAULT_MODEL, backend='mlx', progress=False)\n"
        "except ModelStoreError as exc:\n"
        "    print('ERROR:', exc)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    proc = _run_without_mlx(site_without_mlx, code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout
    assert "pip install 'kakeya_lab[mlx]'" in said and "mlx" in said, said


@pytest.mark.slow
def test_long_run_backend_mlx_without_mlx_is_a_user_error(site_without_mlx, tmp_path):
    out = tmp_path / "run"
    code = (
        "import sys\nfrom kakeya_lab.cli import main\n"
        f"sys.exit(main(['long-run', {str(out)!r}, '--backend', 'mlx', '--turns', '2', "
        "'--arms', 'sink_window', '--probe-every', '0', '--quiet']))\n"
    )
    proc = _run_without_mlx(site_without_mlx, code)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "kakeya_lab[mlx]" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (out / "checkpoint.json").exists()
