"""The pieces of safe exposure without a model: API keys and owners, the Host check, the
bounded admission queue, and ``serve`` refusing a non-loopback bind without a key."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("grpc", reason="needs the serve extra")

from kakeya_lab.serve.admission import Admission, AdmissionRejected  # noqa: E402
from kakeya_lab.serve.api_keys import ANONYMOUS, ApiKeys, read_keys  # noqa: E402
from kakeya_lab.serve.guard import HostCheck  # noqa: E402
from kakeya_lab.session import CapacityExceeded  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_keys_give_owners_that_never_contain_the_key():
    keys = ApiKeys(["alpha-key-123", "beta-key-4567"])
    one, two = keys.owner("Bearer alpha-key-123"), keys.owner("bearer  beta-key-4567 ")
    assert one and two and one != two and one != ANONYMOUS
    assert "alpha-key-123" not in one and keys.owner("Bearer alpha-key-123") == one
    for bad in (None, "", "Bearer", "alpha-key-123", "Basic alpha-key-123", "Bearer alpha-key-12"):
        assert keys.owner(bad) is None, bad
    assert ApiKeys().owner(None) == ApiKeys().owner("Bearer anything") == ANONYMOUS
    assert keys.required and not ApiKeys().required


def test_read_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha-key-123\n\n  beta-key-4567  \n")
    assert read_keys(path, {}) == ["alpha-key-123", "beta-key-4567"]
    assert read_keys(path, {"KAKEYA_LAB_API_KEY": "gamma-key-89"})[-1] == "gamma-key-89"
    assert read_keys(None, {}) == []
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_keys(path, {})
    with pytest.raises(ValueError, match="cannot read"):
        read_keys(tmp_path / "missing", {})
    with pytest.raises(ValueError, match="at least 8"):
        read_keys(None, {"KAKEYA_LAB_API_KEY": "short"})


def test_host_check():
    local = HostCheck("127.0.0.1", ["kakeya.test"])
    for ok in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "kakeya.test:1"):
        assert local.ok(ok), ok
    for bad in (None, "", "evil.example", "evil.example:8000", "10.0.0.5:8000", "kakeya.test.evil"):
        assert not local.ok(bad), bad
    anywhere = HostCheck("0.0.0.0")
    assert anywhere.ok("10.0.0.5:8000") and anywhere.ok("[fe80::1]:80")
    assert not anywhere.ok("evil.example:8000")  # a name may be rebound: only IP literals
    named = HostCheck("localhost")  # a bind given as a name, not an address
    assert named.ok("localhost:8000") and not named.ok("10.0.0.5:8000")


class Slots:
    """A real capacity counter with the store's CapacityExceeded."""

    def __init__(self, free: int, take_s: float = 0.0):
        self.free = free
        self.take_s = take_s
        self.lock = threading.Lock()

    def take(self) -> str:
        time.sleep(self.take_s)
        with self.lock:
            if self.free == 0:
                raise CapacityExceeded("full")
            self.free -= 1
            return "slot"


def test_admission_queue_is_bounded_and_woken_by_release():
    slots = Slots(0)
    admission = Admission("queue", max_wait_s=30, max_waiting=2)
    results: list[object] = []

    def wait() -> None:
        try:
            results.append(admission.admit(slots.take))
        except AdmissionRejected as exc:
            results.append(exc)

    waiters = [threading.Thread(target=wait) for _ in range(2)]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + 10
    while admission.waiting < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(AdmissionRejected, match="queue is full"):
        admission.admit(slots.take)  # a third waiter is refused at once
    assert time.monotonic() - t0 < 5
    for _ in range(2):
        with slots.lock:
            slots.free += 1
        admission.released()
    for w in waiters:
        w.join(timeout=10)
    assert [r[0] for r in results] == ["slot", "slot"]  # type: ignore[index]
    assert all(r[1] > 0 for r in results)  # type: ignore[index]
    assert admission.waiting == 0
    assert Admission("queue", 5).admit(Slots(1).take) == ("slot", 0.0)  # no wait: 0.0 exactly


def test_serve_refuses_a_non_loopback_bind_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "KAKEYA_LAB_API_KEY"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "kakeya_lab.cli", "serve", "--host", "0.0.0.0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "give an API key" in lines[0], done.stderr


def test_a_release_that_frees_nothing_keeps_the_queue_bound():
    """Waiters woken by a release that freed nothing stay counted while they look again,
    so a newcomer never slips past the bound (every ended call wakes the queue)."""
    slots = Slots(0, take_s=0.01)  # a slow try: woken waiters spend a while looking again
    admission = Admission("queue", max_wait_s=5, max_waiting=2)
    results: list[object] = []
    waiters = [
        threading.Thread(target=lambda: results.append(admission.admit(slots.take)))
        for _ in range(2)
    ]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + 10
    while admission.waiting < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    newcomers_in = 0
    full = Slots(0)  # the newcomers find the store full at once
    for _ in range(20):
        admission.released()
        time.sleep(0.002)  # the woken waiters are trying the store now
        try:
            admission.admit(full.take)
            newcomers_in += 1
        except AdmissionRejected as exc:
            assert "queue is full" in str(exc)
    assert newcomers_in == 0 and admission.waiting == 2
    with slots.lock:
        slots.free += 2
    admission.released()
    for w in waiters:
        w.join(timeout=10)
    assert len(results) == 2 and admission.waiting == 0
