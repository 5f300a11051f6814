"""The served process's memory controls (``kakeya_lab.serve.memory``), on this machine's
real C library: the live-heap count that the served footprint tests rely on follows real
allocations, and the arena cap and the trim are taken by glibc."""

from __future__ import annotations

import math
import platform
import subprocess
import sys

import pytest
import torch

from kakeya_lab.serve.memory import heap_in_use_bytes

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the controls are glibc's (mallinfo2, mallopt)"
)

MB = 2**20


def test_the_live_heap_follows_a_tensor_allocated_and_freed():
    before = heap_in_use_bytes()
    assert not math.isnan(before) and before > 0
    x = torch.ones(16 * MB // 4)  # 16 MB of float32, from the C allocator
    held = heap_in_use_bytes()
    del x
    after = heap_in_use_bytes()
    assert held - before >= 16 * MB
    assert abs(after - before) < 2 * MB


def test_glibc_takes_the_arena_cap():
    # in a process of its own: the cap is process-wide and would outlive this test
    code = "from kakeya_lab.serve.memory import limit_arenas; print(limit_arenas())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
