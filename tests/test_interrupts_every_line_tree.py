"""The full line-by-line interrupt sweep of ``test_interrupts`` (its docstring says what is
checked) for tree generation: SIGINT at every executed line of a whole ``generate``.
Slow; one file per kind so the suite's workers share the sweeps (``--dist loadfile``)."""

from __future__ import annotations

import pytest
from test_interrupts import CONSUMERS, model, prompt, sweep  # noqa: F401 (model, prompt: fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_interrupt_at_every_line(model, prompt, consumer):  # noqa: F811
    sweep(model, prompt, "tree", consumer, sample=None)
