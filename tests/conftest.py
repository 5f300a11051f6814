"""Shared fixtures: the default real model (from the offline store) and a tiny random model.

``backend`` runs a test once per registered backend (:mod:`kakeya_lab.backends.registry`),
so registering a backend tests it; ``tiny_backends`` holds the tiny random models on each.
``serve`` starts real ``kakeya-lab serve`` subprocesses on free loopback ports (always
stopped). Observed oracle differences are collected by ``record_tolerance`` and printed at the end of
the run, so every CI log states the tolerances actually reached (and written as JSON to
``$KAKEYA_TOLERANCES_JSON`` when it is set: ``evidence/oracle_agreement/``). Under
pytest-xdist each worker sends its observations to the controller, which prints them all.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from kakeya_lab.backends import registry
from kakeya_lab.models import DEFAULT_MODEL, load_model, tiny_random_model
from kakeya_lab.serve.process import ServerProcess
from kakeya_lab.serve.process import start_server as start_process

_TOLERANCES: list[tuple[str, float]] = []

TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
    "out loud as his father had taught him. At the top he trimmed the wick, polished the "
    "great lens and watched the ships slide past the rocks. Some nights the fog rolled in so "
    "thick that he could not see his own hands, and then he rang the bell every minute until "
    "dawn. The villagers said he never slept, but the truth was simpler: he slept in the "
    "afternoons, when the sea was calm and the gulls were quiet, and he dreamed of mountains. "
)


@pytest.fixture(scope="session")
def default_model():
    """The default real model in fp32 (pulled once into the store, then offline), on the
    kernel ``kakeya-lab serve`` and ``chat`` run by default: ``--linear auto``, the fastest
    measured on this machine for each row count (``make test`` measures it before pytest).
    Its transformers forward runs the same kernels, so the oracles hold it to the same rule."""
    torch.manual_seed(0)
    return load_model(DEFAULT_MODEL, dtype=torch.float32, linear="auto")


@pytest.fixture(scope="session")
def aten_model():
    """The default real model on PyTorch's own kernel: ``load_model``'s default (and the
    long-run command's), for the tests of that default and of one kernel against another."""
    return load_model(DEFAULT_MODEL, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model():
    """A deterministic 2-layer random Qwen3 with the default model's real tokenizer."""
    return tiny_random_model("qwen3", seed=0)


TINY_ARCHITECTURES = ("llama", "qwen3")


@pytest.fixture(params=registry.names())
def backend(request) -> str:
    """Each registered backend's name in turn."""
    return request.param


@pytest.fixture(scope="session")
def tiny_backends(tiny_model, tmp_path_factory) -> dict[str, dict[str, object]]:
    """Tiny random models (2 layers, seed 0; qwen3's is ``tiny_model``) loaded from the same
    safetensors on every registered backend whose runtime is installed: ``{architecture:
    {backend: model}}``. The torch entry is the one the oracles run on."""
    models: dict[str, dict[str, object]] = {}
    for arch in TINY_ARCHITECTURES:
        loaded = tiny_model if arch == "qwen3" else tiny_random_model(arch, seed=0)
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        loaded.model.save_pretrained(folder, safe_serialization=True)
        models[arch] = {"torch": loaded.model}
        for name in registry.names():
            if name == "torch":
                continue
            try:
                models[arch][name] = registry.entry(name).load().load_folder(folder, "float32")
            except ImportError:  # this backend's runtime is not installed here
                pass
    return models


@pytest.fixture(scope="session")
def tiny_on(tiny_backends):
    """``tiny_on(arch, backend)``: the tiny ``arch`` model on ``backend`` (the test is
    skipped when that backend's runtime is not installed)."""

    def pick(arch: str, backend: str):
        if backend not in tiny_backends[arch]:
            pytest.skip(f"the {backend} backend is not installed")
        return tiny_backends[arch][backend]

    return pick


@pytest.fixture(scope="session")
def text_ids(default_model):
    """A few hundred token ids of real English text."""
    return default_model.tokenizer(TEXT * 3, add_special_tokens=False)["input_ids"]


@pytest.fixture
def record_tolerance():
    def record(name: str, value: float) -> None:
        _TOLERANCES.append((name, float(value)))

    return record


def pytest_collection_modifyitems(config, items):
    """Longest first: the notebooks, then the files with ``slow`` tests, then the rest (each
    group in collection order). Under ``--dist loadfile`` a worker takes the next file when
    it is nearly done with one, so a long file sent out last kept one worker busy for
    minutes while the other stood idle. The Makefile passes ``--no-loadscope-reorder``: xdist
    would otherwise send the files out by their number of tests, most first."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(
        key=lambda item: 0 if item.path.suffix == ".ipynb" else 1 if item.path in slow else 2
    )


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set on xdist workers only
    if workeroutput is not None:
        workeroutput["kakeya_tolerances"] = json.dumps(_TOLERANCES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: collect what a finished worker observed."""
    _TOLERANCES.extend(
        (name, value)
        for name, value in json.loads(node.workeroutput.get("kakeya_tolerances", "[]"))
    )


def pytest_terminal_summary(terminalreporter):
    if not _TOLERANCES:
        return
    out = os.environ.get("KAKEYA_TOLERANCES_JSON")  # evidence: the printed numbers as a file
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(dict(_TOLERANCES), indent=1, sort_keys=True) + "\n")
    terminalreporter.section("observed oracle max-abs logit differences (fp32)")
    for name, value in _TOLERANCES:
        terminalreporter.write_line(f"{value:.3e}  {name}")


# ----------------------------------------------------------------- served runtime


SERVER_START_TIMEOUT_S = 600  # a bound on the readiness wait, generous for a busy machine
# A server's footprint after a load or a fault, against its footprint before: open sessions
# and live KV bytes exactly; the live heap (glibc's count of bytes handed out, which a leak
# moves and memory the allocator keeps for reuse does not) within HEAP_TOLERANCE_BYTES, as
# kernels' per-shape caches still grow a little with new shapes (measured: under 2 MB after
# the first 400 turns, then ~0.1 MB per 400); the resident size within
# RSS_TOLERANCE_BYTES (it moves by ~10 MB with how freed pages lie in the arenas).
HEAP_TOLERANCE_BYTES = 4 * 2**20
RSS_TOLERANCE_BYTES = 64 * 2**20


class Server(ServerProcess):
    """A real ``kakeya-lab serve`` subprocess on loopback, with the tests' clients (which
    send ``api_key``: the server's first key, when it was started with keys)."""

    api_key: str | None = None

    def client(self, api_key: str | None = None):
        from kakeya_lab.serve.client import SessionClient

        return SessionClient(self.grpc_target, timeout_s=120, api_key=api_key or self.api_key)

    def openai(self, api_key: str | None = None, **kw):
        import openai

        return openai.OpenAI(
            base_url=f"{self.http_base}/v1",
            api_key=api_key or self.api_key or "x",
            max_retries=0,
            timeout=120,
            **kw,
        )

    def headers(self, api_key: str | None = None) -> dict[str, str]:
        """The Authorization header of ``api_key`` (default: the server's first key)."""
        key = api_key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def cancelled_streams(self) -> float:
        """How many generation streams the server has counted as cancelled."""
        return self.metrics().get("kakeya_streams_total{end=cancelled}", 0)

    def wait_cancelled(self, before: float, timeout_s: float = 120) -> None:
        """Wait until the server counts a cancelled stream beyond ``before`` (the count is
        taken once the session has settled, so its history is then final)."""
        deadline = time.monotonic() + timeout_s
        while self.cancelled_streams() == before:
            assert time.monotonic() < deadline, "the server kept generating after the client left"
            time.sleep(0.1)

    def footprint(self) -> dict[str, float]:
        """Open sessions, live KV bytes, live heap bytes and resident bytes (/metrics)."""
        m = self.metrics()
        return {
            "sessions": m["kakeya_sessions_open"],
            "kv": m["kakeya_kv_live_bytes"],
            "heap": m["kakeya_heap_in_use_bytes"],
            "rss": m["process_resident_memory_bytes"],
        }

    def assert_back_to(self, before: dict[str, float], timeout_s: float = 60) -> None:
        """Assert that the server's :meth:`footprint` is back to ``before`` (sessions and
        KV exactly, heap and RSS within their tolerances), waiting up to ``timeout_s`` for
        it to settle: a finished stream's last objects are freed a moment after its client
        has the reply."""
        deadline = time.monotonic() + timeout_s
        while True:
            after = self.footprint()
            settled = (
                after["sessions"] == before["sessions"]
                and after["kv"] == before["kv"]
                and after["heap"] - before["heap"] <= HEAP_TOLERANCE_BYTES
            )
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert after["sessions"] == before["sessions"], (before, after)
        assert after["kv"] == before["kv"], (before, after)
        assert after["heap"] - before["heap"] <= HEAP_TOLERANCE_BYTES, (before, after)
        assert after["rss"] - before["rss"] <= RSS_TOLERANCE_BYTES, (before, after)

    def metrics(self) -> dict[str, float]:
        """The server's /metrics samples as ``name{label=value,...}`` -> value."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.http_base}/metrics", timeout=30, headers=self.headers()).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values


def start_server(
    *extra: str, model: str = DEFAULT_MODEL, api_keys: tuple[str, ...] = (), key_dir=None
) -> Server:
    """:func:`kakeya_lab.serve.process.start_server`, with the tests' clients attached.
    ``api_keys``: written to a key file in ``key_dir`` (``--api-key-file``); the clients
    send the first."""
    if api_keys:
        if key_dir is None:
            raise ValueError("api_keys need a key_dir (e.g. tmp_path) for the key file")
        key_file = Path(key_dir) / "api-keys"
        key_file.write_text("\n".join(api_keys) + "\n")
        extra = (*extra, "--api-key-file", str(key_file))
    env = {k: v for k, v in os.environ.items() if k != "KAKEYA_LAB_API_KEY"}
    p = start_process(*extra, model=model, timeout_s=SERVER_START_TIMEOUT_S, env=env)
    server = Server(p.proc, p.grpc_target, p.http_base, p.stderr, p.ready)
    server.api_key = api_keys[0] if api_keys else None
    return server


@pytest.fixture(scope="module")
def serve():
    """A factory: ``serve(*args)`` starts a real server (:func:`start_server`); every server
    it started is stopped when the module ends, whatever happened."""
    started: list[Server] = []

    def start(*extra: str, model: str = DEFAULT_MODEL, **keys) -> Server:
        server = start_server(*extra, model=model, **keys)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def plain_greedy(store, sid: str, ids: list[int], max_new: int) -> list[int]:
    """Append ``ids`` to the in-process session ``sid`` of ``store`` and decode ``max_new``
    tokens greedily (plain decoding): the token ids (the oracle of served replies)."""
    from kakeya_lab.session import Token

    store.append(sid, ids)
    return [e.id for e in store.generate(sid, max_new) if isinstance(e, Token)]


def grpc_turns_equal_plain(
    client, store, tokenizer, turns: list[tuple[str, str]], max_new: int
) -> tuple[str, object, list[list]]:
    """Drive a new gRPC text session over ``client`` through ``turns`` (each a user message
    and the proposer its reply streams with, drafts of 4) and assert every reply equals
    in-process plain greedy decoding of the same ids on ``store`` (a ``SessionStore`` over
    the same model and cache), and the histories end equal. Returns the session's id (left
    open), its final info (history included) and each turn's speculative steps."""
    from kakeya_lab.chat import ChatTemplate

    chat = ChatTemplate(tokenizer)  # what the server's template does
    oracle = store.create()
    steps = []
    sid = client.create()
    for question, proposer in turns:
        client.append_text(sid, question)
        ids = chat.user(question)
        events = list(client.stream(sid, max_new, proposer=proposer, draft_length=4))
        got = [e.token.id for e in events if e.WhichOneof("event") == "token"]
        assert got == plain_greedy(store, oracle, ids, max_new), (question, proposer)
        chat.generated(got, eos_token_ids=[tokenizer.eos_token_id])
        steps.append([e.step for e in events if e.WhichOneof("event") == "step"])
    info = client.info(sid, include_history=True)
    assert list(info.history) == store.verifier(oracle).history_token_ids
    store.close(oracle)
    return sid, info, steps


class drafters_home:
    """``KAKEYA_LAB_DRAFTERS`` set to ``path`` inside the block (for this process and the
    servers it starts), restored after."""

    def __init__(self, path):
        self.path = str(path)

    def __enter__(self):
        self.old = os.environ.get("KAKEYA_LAB_DRAFTERS")
        os.environ["KAKEYA_LAB_DRAFTERS"] = self.path
        return self

    def __exit__(self, *exc):
        if self.old is None:
            del os.environ["KAKEYA_LAB_DRAFTERS"]
        else:
            os.environ["KAKEYA_LAB_DRAFTERS"] = self.old
