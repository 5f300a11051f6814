"""release_thread_pool ends the calling thread's OpenMP workers in the runtime PyTorch runs
on, also when another wheel has loaded its own copy of GNU OpenMP (sentencepiece does).

Runs in a subprocess with two torch threads: a pool is per thread and process-wide state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, threading
    import sentencepiece  # noqa: F401  (brings its own libgomp)
    import torch
    from kakeya_lab.backends.thread_pool import release_thread_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    counts = {}
    def work():
        counts["before"] = threads()
        x = torch.randn(512, 512)
        (x @ x).sum()  # a parallel region: this thread's pool of torch.get_num_threads() - 1
        counts["pooled"] = threads()
        counts["released"] = release_thread_pool()
        counts["after"] = threads()
        (x @ x).sum()  # a new pool, built on demand
        counts["again"] = threads()

    torch.set_num_threads(2)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    gomp = sorted({l.split()[-1] for l in open("/proc/self/maps") if "/libgomp" in l})
    print(json.dumps({**counts, "runtimes": len(gomp)}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP on Linux")
def test_release_ends_the_calling_threads_pool_in_torchs_runtime():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["runtimes"] == 2  # torch's and sentencepiece's: the right one must be found
    assert counts["pooled"] == counts["before"] + 1  # one worker beside the thread
    assert counts["released"] is True
    assert counts["after"] == counts["before"]  # the worker ended
    assert counts["again"] == counts["pooled"]
