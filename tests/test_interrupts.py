"""Interrupt-atomic generation (docs/design.md, "Interrupts"), tested the way the defects
were found.

The invariant, after a ``KeyboardInterrupt`` or a proposer's error escaping anywhere in a
``generate`` (or the stream being closed or dropped): the session's committed history is
the prompt plus exactly the tokens ``next()`` returned, its next-token logits are those of
a clean session that appended that history (so its next greedy reply is the clean one's),
and no later call is wedged.

* Line-by-line injection: a trace function delivers SIGINT at the N-th executed line of the
  session and decoder modules, for every N of a whole ``generate`` (plain, n-gram chain,
  n-gram tree; consumed to the end, or stopped with ``close()`` after a few tokens), with a
  prompt and reply that outgrow a small sink window (eviction at every step). "Delivers
  SIGINT" means what the interpreter does when the signal arrives: it calls the current
  SIGINT handler, so the default handler raises ``KeyboardInterrupt`` there and a
  critical section's deferring handler records it.
* A proposer whose ``propose``/``propose_tree``/``accept`` raises at its k-th call, for
  every k.
* A soak with real SIGINTs sent from another thread at random times.

Tiny random model (mechanics only), with a small vocabulary (``VOCAB``) for the sweeps.
"""

from __future__ import annotations

import linecache
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import pytest
import torch

import kakeya_lab
from kakeya_lab import SinkWindowConfig
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.models import tiny_random_model
from kakeya_lab.proposers.ngram import NgramProposer
from kakeya_lab.proposers.trees import NgramTreeProposer
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.session import SessionStore, Token, chat_turn, collect_reply

CONFIG = SinkWindowConfig(sink=2, window=8)  # budget 10: the prompt alone evicts
REPLY = 8
DRAFT = 4
TOL = 1e-4
PROMPT_TEXT = "the cat sat on the mat and the cat sat on the mat and the dog"

_PACKAGE = Path(kakeya_lab.__file__).parent
# The modules that keep a generation's state, above the backend's forward (atomic on its
# own, tests/test_verifier_atomic.py). A proposer's insides are not traced: its state is
# resynchronised from the context, and a proposer that raises is tested below.
TRACED = frozenset(
    str(p)
    for p in [
        *(_PACKAGE / "session").glob("*.py"),
        _PACKAGE / "speculative.py",
        _PACKAGE / "tree.py",
        _PACKAGE / "verifier.py",
        _PACKAGE / "backends" / "seam.py",
    ]
)

KINDS: dict[str, Callable[[], object]] = {
    "plain": lambda: None,
    "chain": NgramProposer,
    "tree": NgramTreeProposer,
}


# The sweeps run thousands of generates; on the tiny model half of each step is the output
# projection over the tokenizer's 49,152 ids. The prompt's ids are all below this, and a
# model of this vocabulary only ever generates ids below it.
VOCAB = 4096


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("qwen3", seed=0, vocab_size=VOCAB).model


@pytest.fixture(scope="module")
def prompt(tiny_model) -> list[int]:
    ids = tiny_model.tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > CONFIG.budget and max(ids) < VOCAB
    return ids


@contextmanager
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler for the duration (a background test run starts with
    SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class Interrupter:
    """A trace function that delivers SIGINT at the ``at``-th executed line of the
    :data:`TRACED` modules (0: never; ``lines`` counts them)."""

    def __init__(self, at: int):
        self.at = at
        self.lines = 0
        self.where: str | None = None

    def trace(self, frame: FrameType, event: str, arg: object):
        return self._line if frame.f_code.co_filename in TRACED else None

    def _line(self, frame: FrameType, event: str, arg: object):
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
                handler = signal.getsignal(signal.SIGINT)
                assert callable(handler)
                handler(signal.SIGINT, frame)  # raises KeyboardInterrupt, or is deferred
        return self._line


class Clean:
    """A clean session's next-token logits and next greedy reply after a history (cached)."""

    def __init__(self, model):
        self.model = model
        self._seen: dict[tuple[int, ...], tuple[torch.Tensor, list[int]]] = {}

    def __call__(self, history: list[int]) -> tuple[torch.Tensor, list[int]]:
        key = tuple(history)
        if key not in self._seen:
            store = SessionStore(self.model, CONFIG, eos_token_ids=[])
            sid = store.create()
            store.append(sid, history)
            logits = store.next_token_logits(sid)
            assert logits is not None
            self._seen[key] = (logits, collect_reply(store.generate(sid, 2)).token_ids)
        return self._seen[key]


def broken(store: SessionStore, sid: str, history: list[int], clean: Clean) -> str | None:
    """What is wrong with the session after a cut-short generate (None: nothing)."""
    try:
        info = store.info(sid)
        got = store.verifier(sid).history_token_ids
        if got != history:
            at = next((i for i, (g, h) in enumerate(zip(got, history)) if g != h), None)
            if at is None:
                return f"history has {len(got)} tokens, {len(history)} received (prompt included)"
            return f"history differs from what was received at position {at}"
        if info.history_len != len(history):
            return f"info() reports {info.history_len} tokens of history, {len(history)} received"
        logits = store.next_token_logits(sid)
        want_logits, want_reply = clean(history)
        assert logits is not None
        diff = (logits - want_logits).abs().max().item()
        if diff > TOL:
            return f"stale next-token logits (max diff {diff:.2e})"
        reply = collect_reply(store.generate(sid, 2)).token_ids
        if reply != want_reply:
            return f"next greedy reply {reply}, a clean session's {want_reply}"
    except Exception as exc:  # e.g. "a provisional block is open": the session is wedged
        return f"wedged: {type(exc).__name__}: {exc}"
    return None


# How a stream is consumed: closed after that many tokens (None: to the end), and the
# sampling (greedy accepts drafts; sampling makes a reply of distinct tokens, so a token
# committed in place of another shows).
CONSUMERS: dict[str, tuple[int | None, SamplingConfig | None]] = {
    "greedy-to-the-end": (None, None),
    "sampled-close-after-4": (4, SamplingConfig(temperature=1.0, seed=0)),
}


def interrupted_generate(
    model, prompt: list[int], kind: str, at: int, consumer: str
) -> tuple[SessionStore, str, list[int], Interrupter]:
    """One generate with SIGINT delivered at line ``at``, consumed as ``consumer`` says;
    the store, the session and the tokens next() returned."""
    stop_after, sampling = CONSUMERS[consumer]
    store = SessionStore(model, CONFIG, eos_token_ids=[])
    sid = store.create()
    store.append(sid, prompt)
    proposer = KINDS[kind]()
    received: list[object] = []
    interrupter = Interrupter(at)
    stream = None
    with default_sigint():
        sys.settrace(interrupter.trace)
        try:
            stream = store.generate(sid, REPLY, sampling, proposer=proposer, draft_length=DRAFT)
            for event in stream:
                received.append(event)  # first: nothing can interrupt before it
                if sum(isinstance(e, Token) for e in received) == stop_after:
                    stream.close()
                    break
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
    del stream
    return store, sid, [e.id for e in received if isinstance(e, Token)], interrupter


def sweep(model, prompt, kind: str, consumer: str, sample: int | None) -> None:
    """Deliver SIGINT at every executed line (``sample``: at about that many evenly
    spaced lines) of one generate; assert the invariant after each."""
    clean = Clean(model)
    _, _, tokens, counted = interrupted_generate(model, prompt, kind, 0, consumer)
    assert len(tokens) == (CONSUMERS[consumer][0] or REPLY)
    total = counted.lines
    points = range(1, total + 1, 1 if sample is None else max(1, total // sample))
    failures = []
    for at in points:
        store, sid, received, interrupter = interrupted_generate(model, prompt, kind, at, consumer)
        problem = broken(store, sid, prompt + received, clean)
        if problem is not None:
            failures.append(f"line {at} ({interrupter.where}): {problem}")
    print(f"{kind} {consumer}: {len(points)} of {total} points, {len(failures)} broken")
    assert not failures, f"{len(failures)} of {len(points)} points broken:\n" + "\n".join(
        failures[:20]
    )


@pytest.mark.parametrize("consumer", list(CONSUMERS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_interrupt_at_sampled_lines(model, prompt, kind, consumer):
    """A dozen evenly spaced points of the full sweeps (the fast loop's share)."""
    sweep(model, prompt, kind, consumer, sample=12)


# The full sweeps, every line: tests/test_interrupts_every_line_{plain,chain,tree}.py.


# ------------------------------------------------------------ failing proposers
class ProposerFailure(RuntimeError):
    pass


class Failing:
    """Raise :class:`ProposerFailure` at the ``at``-th call of ``method`` (0: never);
    ``calls`` counts the calls."""

    def __init__(self, method: str, at: int):
        self.method, self.at, self.calls = method, at, 0

    def __call__(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.calls == self.at:
                raise ProposerFailure(f"{method} fails at call {self.at}")


class FailingChain(NgramProposer):
    """An n-gram proposer whose ``propose`` or ``accept`` raises (the input under test)."""

    def __init__(self, failing: Failing):
        super().__init__()
        self.failing = failing

    def propose(self, *args, **kwargs):
        self.failing("propose")
        return super().propose(*args, **kwargs)

    def accept(self, n: int) -> None:
        self.failing("accept")
        super().accept(n)


class FailingTree(NgramTreeProposer):
    """An n-gram tree proposer whose ``propose_tree`` or ``accept`` raises."""

    def __init__(self, failing: Failing):
        super().__init__()
        self.failing = failing

    def propose_tree(self, *args, **kwargs):
        self.failing("propose")
        return super().propose_tree(*args, **kwargs)

    def accept(self, n: int) -> None:
        self.failing("accept")
        super().accept(n)


def _failing_generate(model, prompt, cls, failing: Failing) -> tuple[SessionStore, str, list[int]]:
    store = SessionStore(model, CONFIG, eos_token_ids=[])
    sid = store.create()
    store.append(sid, prompt)
    received: list[int] = []
    sampled = SamplingConfig(temperature=1.0, seed=0)  # a reply of distinct tokens
    try:
        for event in store.generate(sid, REPLY, sampled, proposer=cls(failing), draft_length=DRAFT):
            if isinstance(event, Token):
                received.append(event.id)
    except ProposerFailure:
        pass
    return store, sid, received


@pytest.mark.parametrize("method", ["propose", "accept"])
@pytest.mark.parametrize("cls", [FailingChain, FailingTree], ids=["chain", "tree"])
def test_a_failing_proposer_rolls_its_step_back(model, prompt, cls, method):
    clean = Clean(model)
    counter = Failing(method, 0)
    _, _, tokens = _failing_generate(model, prompt, cls, counter)
    assert len(tokens) == REPLY and counter.calls >= 2
    failures = []
    for at in range(1, counter.calls + 1):
        store, sid, received = _failing_generate(model, prompt, cls, Failing(method, at))
        assert len(received) < REPLY or method == "accept"
        problem = broken(store, sid, prompt + received, clean)
        if problem is not None:
            failures.append(f"{method} call {at}: {problem}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ real SIGINT
class Sender(threading.Thread):
    """Sends SIGINT to this process at a random time in ``(0, max_delay_s)`` after each
    :meth:`arm`, unless :meth:`disarm` came first."""

    def __init__(self, seed: int, max_delay_s: float):
        super().__init__(daemon=True)
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.lock = threading.Lock()
        self.armed = threading.Event()
        self.stopped = False
        self.sent = 0

    def arm(self) -> None:
        self.armed.set()

    def disarm(self) -> None:
        with self.lock:
            self.armed.clear()

    def run(self) -> None:
        while not self.stopped:
            if not self.armed.wait(timeout=0.1):
                continue
            threading.Event().wait(self.rng.uniform(0.0, self.max_delay_s))
            with self.lock:
                if self.armed.is_set():
                    self.armed.clear()
                    os.kill(os.getpid(), signal.SIGINT)
                    self.sent += 1


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Swallows a SIGINT sent for a generate that finished before it arrived."""


@pytest.mark.slow
def test_real_sigint_soak(model, prompt):
    """500 real SIGINTs landing inside generates (plain, chain, tree; several generates
    per session), each followed by the invariant check."""
    clean = Clean(model)
    rng = random.Random(0)
    sender = Sender(seed=1, max_delay_s=0.04)
    sender.start()
    interrupts, generates, failures = 0, 0, []
    before = signal.getsignal(signal.SIGINT)
    try:
        while interrupts < 500:
            store = SessionStore(model, CONFIG, eos_token_ids=[])
            sid = store.create()
            store.append(sid, prompt)
            history = list(prompt)
            for _ in range(3):
                kind = rng.choice(list(KINDS))
                received: list[object] = []
                got_interrupt = False
                try:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    sender.arm()
                    for event in store.generate(
                        sid, REPLY, proposer=KINDS[kind](), draft_length=DRAFT
                    ):
                        received.append(event)  # first: nothing can interrupt before it
                except KeyboardInterrupt:
                    got_interrupt = True
                except Exception as exc:  # anything else escaping a generate is a defect
                    failures.append(f"generate {generates + 1} ({kind}): {exc!r}")
                    break
                finally:
                    signal.signal(signal.SIGINT, _ignore)
                    sender.disarm()
                generates += 1
                interrupts += got_interrupt
                history += [e.id for e in received if isinstance(e, Token)]
                problem = broken(store, sid, history, clean)
                if problem is not None:
                    failures.append(f"generate {generates} ({kind}): {problem}")
                    break
                history += clean(history)[1]  # broken() generated the clean reply
    finally:
        sender.stopped = True
        sender.disarm()
        sender.join()
        signal.signal(signal.SIGINT, before)
    print(f"{interrupts} interrupts in {generates} generates ({sender.sent} SIGINTs sent)")
    assert not failures, f"{len(failures)} broken generates:\n" + "\n".join(failures[:20])


# ------------------------------------------------------------------- chat turns
def test_a_chat_turn_records_what_the_session_kept(tiny_model):
    """SIGINT right after the stream handed a token to :class:`ChatTurn` and before the turn
    noted it: the template still records exactly the tokens the session committed (the
    full-vocabulary model: a rendered chat has ids of every range)."""
    store = SessionStore(tiny_model.model, CONFIG, eos_token_ids=[])
    sid = store.create()
    chat = ChatTemplate(tiny_model.tokenizer)
    turn = chat_turn(store, sid, chat, PROMPT_TEXT, REPLY)
    turn_file = str(_PACKAGE / "session" / "turn.py")
    seen = {"tokens": 0}

    def trace(frame: FrameType, event: str, arg: object):
        if frame.f_code.co_filename != turn_file or frame.f_code.co_name != "__next__":
            return None

        def line(frame: FrameType, event: str, arg: object):
            text = linecache.getline(turn_file, frame.f_lineno).strip()
            if event == "line" and text == "if isinstance(event, Token):":
                seen["tokens"] += 1
                if seen["tokens"] == 3:  # the third token is out of the stream, not noted
                    signal.default_int_handler(signal.SIGINT, frame)
            return line

        return line

    sys.settrace(trace)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in turn:
                pass
    finally:
        sys.settrace(None)
    history = store.verifier(sid).history_token_ids
    assert seen["tokens"] == 3 and not chat.awaiting_reply
    assert turn.token_ids == history[len(history) - 3 :]
    assert tiny_model.tokenizer.decode(history, skip_special_tokens=False) == chat.rendered
