"""release_thread_pool ends the calling thread's OpenMP workers in the runtime PyTorch runs
on, also when another wheel has loaded its own copy of GNU OpenMP (sentencepiece does); and
sessions stepping through a StepBatcher leave only its worker's pool computing.

Each runs in a subprocess with two torch threads: a pool is per thread and process-wide
state."""

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


BATCHER_SCRIPT = textwrap.dedent(
    """
    import json, os, threading
    import torch
    from kakeya_lab import SinkWindowConfig, Verifier, load_model
    from kakeya_lab.backends.thread_pool import release_thread_pool
    from kakeya_lab.backends.torch_batch import StepBatcher, batch_verifier
    from kakeya_lab.models import DEFAULT_MODEL

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    model = load_model(DEFAULT_MODEL, dtype=torch.float32, progress=False).model
    release_thread_pool()  # the main thread's pool (loading ran parallel regions)
    batcher = StepBatcher(model, idle_s=30)  # its worker stays for the counts below
    sessions = 3
    prompt = list(range(100, 160))  # longer than a batched block: each thread prefills it
    barrier = threading.Barrier(sessions + 1)
    errors = []

    def session():
        try:
            v = Verifier(model, SinkWindowConfig(sink=4, window=28))
            logits = v.append(prompt)
            barrier.wait()  # counted: each thread's prefill left a pool in it
            barrier.wait()
            batch_verifier(v, batcher)
            for _ in range(40):  # past eviction
                logits = v.append([int(logits.argmax())])
            batcher.leave(v.cache)
            barrier.wait()  # counted: the batched steps let the session pools go
            barrier.wait()
        except BaseException as e:
            errors.append(repr(e))
            barrier.abort()

    counts = {"before": threads()}
    workers = [threading.Thread(target=session) for _ in range(sessions)]
    for w in workers:
        w.start()
    barrier.wait()
    counts["prefilled"] = threads()
    barrier.wait()
    barrier.wait()
    counts["batched"] = threads()
    batches = list(batcher.batches)
    barrier.wait()
    for w in workers:
        w.join()
    print(json.dumps({**counts, "errors": errors, "most_rows": max(batches)}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GNU OpenMP on Linux")
@pytest.mark.slow
def test_sessions_stepping_through_the_batcher_leave_one_pool_computing():
    """Three session threads prefill on their own (each then holds an OpenMP pool), then
    step through one StepBatcher: while they are still alive, only the batcher's worker and
    its pool remain beside them (a pool per session would slow every step)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", BATCHER_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["errors"] == []
    assert counts["most_rows"] > 1  # the sessions' steps shared forwards
    sessions = counts["before"] + 3
    assert counts["prefilled"] == sessions + 3  # each session thread and its pool's worker
    # beside the sessions at most the batcher's worker and its pool's: the sessions' are gone
    # (with them: sessions + 5)
    assert counts["batched"] <= sessions + 2
