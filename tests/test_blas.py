"""The system BLAS under MLX on Linux (kakeya_lab/blas.py): it is really in use when
installed, and it changes nothing but rounding (logits of the same forward agree)."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("mlx_lm")

_PROBE = r"""
import json, sys
import kakeya_lab
from kakeya_lab.blas import mlx_blas
from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.backends.mlx_backend import load_mlx_model
from kakeya_lab.models import model_dir
import numpy as np
model = load_mlx_model(model_dir("smollm2-135m-instruct"))
verifier = Verifier(model, SinkWindowConfig(sink=4, window=28))
ids = list(range(200, 296))
rows = [np.asarray(verifier.append(ids[i : i + 8]), dtype=np.float64) for i in range(0, 96, 8)]
print(json.dumps({"blas": mlx_blas(), "logits": np.stack(rows).tolist()}))
"""


def _probe(**env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bundled BLAS is Linux's")
def test_system_blas_is_used_and_agrees_with_the_bundled_one() -> None:
    system = ctypes.util.find_library("openblas")
    if system is None and os.environ.get("CI"):
        pytest.fail("CI needs Debian's libopenblas0-pthread (.ci/run installs it)")
    if system is None:
        pytest.skip("no system OpenBLAS installed")
    fast = _probe()
    bundled = _probe(KAKEYA_MLX_BLAS="bundled")
    assert fast["blas"] == system
    assert bundled["blas"] == "bundled"
    import numpy as np

    a, b = np.asarray(fast["logits"]), np.asarray(bundled["logits"])
    assert a.shape == b.shape and a.shape[0] == 12
    # Same fp32 products, different summation order: rounding-level differences only,
    # across a block that wraps the window three times.
    assert np.abs(a - b).max() <= 1e-3
