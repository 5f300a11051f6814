"""Speculative-decoding benchmark: proposers × draft lengths against plain decoding of the
same verifier and cache, side by side in one process, over multi-turn conversations.

For every conversation turn each arm (``plain`` and every ``proposer@draft_length``, e.g.
``ngram@4``) appends the same
chat-templated user message to its own session and generates a reply; arms alternate turn
by turn so they share machine conditions. Greedy arms stay on identical histories (the
decoder is lossless), so per-turn speedups compare like with like.

Metrics follow `docs/design.md` ("Metrics"): acceptance rate (accepted / proposed), ``tau`` (tokens
emitted per verifier forward; 1.0 for plain decoding), acceptance by draft position,
proposer and verifier seconds, tokens/s, ``speedup`` (speculative tokens/s ÷ plain tokens/s
over the same turns) and the Leviathan et al. (2023) expectation
``(1 - a^(k+1)) / ((1 - a)(k c + 1))`` (``k`` the draft length) with ``a`` and ``c`` measured
here and recorded under their own names:

* ``acceptance_probability`` (``a``) — per-token acceptance probability, estimated as
  accepted / (accepted + rejections) (each step is a run of Bernoulli trials stopped by the
  first rejection); ``acceptance_rate`` is the plain share accepted / proposed;
* ``draft_cost_ratio`` (``c``) — proposer seconds per drafted token ÷ plain-decoding seconds
  per token.

The fitted cost model of the run (this machine's verifier block cost ``v(n)``, each arm's
drafting cost and the speedup they predict) is ``run.cost``, see
:mod:`kakeya_lab.bench.speculative_cost`.

Table columns: ``turns`` and ``steps`` carry ``draft_length`` (0 for plain decoding); the
summary adds ``acceptance_rate``, ``acceptance_probability``, ``draft_cost_ratio``,
``expected_speedup``, ``acceptance_by_position`` and ``zero_accept_rate`` (the share of
steps with a draft that accepted none of it).

Tree arms (a :class:`~kakeya_lab.proposers.TreeProposer`, e.g. ``suffix-tree@16``): the
draft length is the node budget, ``proposed`` counts the tree's nodes and ``accepted``
the accepted path's length, so ``acceptance_rate`` is accepted path nodes per verified
node, ``acceptance_by_position`` the share of steps accepting at least ``i + 1`` tokens;
``acceptance_probability`` and ``expected_speedup`` (chain formulas) are left empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from kakeya_lab.bench.speculative_cost import (
    BlockCostProbe,
    RunCostModel,
    run_cost_model,
)
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.chat import ChatTemplate
from kakeya_lab.cost_model import CostModel, block_padding, fit_block_cost
from kakeya_lab.data import Conversation
from kakeya_lab.linear import kernel_switched, linear_kernel_of
from kakeya_lab.linear_auto import full_precision_kernels
from kakeya_lab.proposers import Proposer, is_tree_proposer
from kakeya_lab.sampling import SamplingConfig
from kakeya_lab.session import SessionStore, chat_turn, collect_reply

ProposerFactory = Callable[[], Proposer]


@dataclass
class SpeculativeRun:
    turns: pd.DataFrame  # one row per (arm, conversation, turn)
    steps: pd.DataFrame  # one row per verifier step of a speculative arm
    summary: pd.DataFrame  # one row per arm
    cost: RunCostModel | None = None  # the run's fitted cost model (measure_cost=True)
    block_padding: dict[int, int] | None = None  # the @padK arms' plan (pad_blocks=True)
    plain_kernel: str = ""  # the linear kernel of the "plain" arm: the fastest plain decoding
    plain_tokens_per_s: dict[str, float] | None = None  # plain decoding per kernel tried

    def baseline(self) -> str:
        """One line: plain decoding's tokens/s on each kernel tried, and which one, the
        fastest, every speedup is against (empty on a backend with no torch kernels)."""
        if not (self.plain_kernel and self.plain_tokens_per_s):
            return ""
        rates = ", ".join(f"{k} {v:.1f}" for k, v in self.plain_tokens_per_s.items())
        return (
            f"plain decoding, tokens/s by linear kernel: {rates}; the fastest "
            f"({self.plain_kernel}) is the baseline of every speedup"
        )


@dataclass(frozen=True)
class AssistedGeneration:
    """transformers' assisted generation against its own plain ``generate`` (same prompts)."""

    plain_tokens_per_s: float
    assisted_tokens_per_s: float
    speedup: float  # assisted tokens/s ÷ plain tokens/s
    identical_output: bool  # every assisted sequence equal to the plain one

    def to_dict(self) -> dict[str, float | bool]:
        return asdict(self)


def leviathan_speedup(
    acceptance_probability: float, draft_length: int, draft_cost_ratio: float
) -> float:
    """Expected walltime improvement of Leviathan et al. (2023): ``(1 - a^(k+1)) /
    ((1 - a)(k c + 1))`` with ``a`` the per-token acceptance probability, ``k`` the draft
    length and ``c`` the cost of one drafted token relative to one verifier step."""
    a, k, c = acceptance_probability, draft_length, draft_cost_ratio
    if a >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def run_speculative(
    loaded,
    proposers: Mapping[str, ProposerFactory],
    conversations: Sequence[Conversation],
    settings: SpeculativeSettings,
    *,
    system: str | None = None,
    progress: bool = True,
) -> SpeculativeRun:
    """Run ``plain`` and one ``proposer@draft_length`` arm per proposer and draft length of
    ``settings`` over the first ``settings.turns`` user turns of each of ``conversations``.
    A proposer keyed ``SPEC@K`` runs at ``K`` only (``settings.draft_lengths`` may then be
    empty).

    With ``settings.measure_cost`` the verifier's block cost ``v(n)`` for ``n = 1..max(draft
    length) + 1`` is timed ``settings.cost_repeats`` times per size before the arms run and
    again after them (:class:`~kakeya_lab.bench.speculative_cost.BlockCostProbe`), and
    ``run.cost`` holds the fitted cost model with each arm's predicted speedup
    (:mod:`kakeya_lab.bench.speculative_cost`).

    ``settings.cost_aware`` adds one arm per proposer, ``NAME@costK`` with ``K =
    max(draft_lengths)``, whose draft length (chains) or node budget (trees) is chosen
    per step by :class:`~kakeya_lab.cost_model.CostAwareDraftLength` /
    :class:`~kakeya_lab.cost_model.CostAwareTreeSize` from the block cost measured
    before the arms run (:func:`~kakeya_lab.cost_model.fit_block_cost`), at most ``K``.

    ``settings.pad_blocks`` adds ``NAME@padK`` beside every chain arm ``NAME@K``: the same
    proposer, with every verifier block scored at the cheapest measured size at least as
    large (:func:`~kakeya_lab.cost_model.block_padding` of the timings taken before the
    arms run; tree arms are not padded, so they get none).

    ``settings.plain_kernels`` (torch) times plain decoding on each of those full-precision
    kernels that this machine runs as a kernel of its own (``split`` needs two threads) too,
    as more plain arms beside the others; the fastest (tokens/s over the run)
    becomes ``plain``, the baseline of every speedup, and the others stay as
    ``plain[KERNEL]`` rows; ``run.plain_kernel`` names the winner and
    ``run.plain_tokens_per_s`` has every kernel's rate. The other arms run the model's own
    kernel. Each kernel takes one throwaway step before any arm is timed
    (:meth:`~kakeya_lab.session.SessionStore.warm_up`).

    Raises ValueError for no conversations, or a proposer key with no draft length."""
    if not conversations:
        raise ValueError("no conversations to run")
    draft_lengths = settings.draft_lengths
    if not (draft_lengths or all("@" in name for name in proposers)):
        raise ValueError(f"draft lengths must be >= 1, got {list(draft_lengths)}")
    config = settings.cache()
    turns_per_conversation, max_new_tokens = settings.turns, settings.max_new_tokens
    temperature, seed, cost_repeats = settings.temperature, settings.seed, settings.cost_repeats
    Arm = tuple[ProposerFactory | None, int, CostModel | None, dict[int, int] | None]
    arms: dict[str, Arm] = {"plain": (None, 0, None, None)}
    plan = None
    lengths = {name: arm_draft_lengths(name, draft_lengths) for name in proposers}
    for name, factory in proposers.items():
        for n in lengths[name]:
            arms[f"{_spec_of(name)}@{n}"] = (factory, n, None, None)
    longest = max(n for ns in lengths.values() for n in ns)
    model, tok = loaded.model, loaded.tokenizer
    probe = None
    if settings.measure_cost:
        probe = BlockCostProbe(loaded, config, conversations, longest + 1, system=system)
        probe.measure(cost_repeats)
    if settings.cost_aware and probe is not None:
        # the schedules measure the drafter's own cost as they decode
        planned = CostModel(fit_block_cost(probe.timings), draft_token_s=0.0)
        for name, factory in proposers.items():
            k = max(lengths[name])
            arms[f"{_spec_of(name)}@cost{k}"] = (factory, k, planned, None)
    if settings.pad_blocks and probe is not None:
        plan = block_padding(probe.timings)
        for name, factory in proposers.items():
            if not is_tree_proposer(factory()):
                for n in lengths[name]:
                    arms[f"{_spec_of(name)}@pad{n}"] = (factory, n, None, plan)
    own_kernel = linear_kernel_of(model) if isinstance(model, torch.nn.Module) else ""
    plain_arm = {"plain": own_kernel}
    runnable = full_precision_kernels() if own_kernel else ()
    for kernel in settings.plain_kernels if own_kernel else ():
        if kernel != own_kernel and kernel in runnable:  # split on one thread would be aten
            plain_arm[f"plain[{kernel}]"] = kernel
            arms[f"plain[{kernel}]"] = (None, 0, None, None)
    # one throwaway step on each kernel before any arm is timed, so that no arm's first turn
    # pays for its kernel's one-time work (packing exact's integer forms; oneDNN's state for
    # the one- and two-row shapes the step meets; other block sizes still build theirs)
    for arm, kernel in plain_arm.items():
        with kernel_switched(model, kernel) if arm != "plain" else nullcontext():
            SessionStore(model, config, capacity=1).warm_up()
    turn_rows, step_rows = [], []
    total = sum(min(turns_per_conversation, len(c.turns[0::2])) for c in conversations) * len(arms)
    bar = tqdm(total=total, desc="speculative", unit="turn", disable=not progress)
    for ci, conv in enumerate(conversations):
        user_turns = list(conv.turns[0::2])[:turns_per_conversation]
        sessions = {}
        for arm, (make_proposer, draft_length, cost_model, padding) in arms.items():
            store = SessionStore(model, config, capacity=1, block_padding=padding)
            sessions[arm] = (
                store,
                store.create(),
                ChatTemplate(tok, system=system),
                make_proposer() if make_proposer else None,
                draft_length,
                cost_model,
            )
        for ti, text in enumerate(user_turns):
            for arm, (store, sid, chat, proposer, draft_length, cost_model) in sessions.items():
                sampling = SamplingConfig(temperature=temperature, seed=seed + 1000 * ci + ti)
                turn = chat_turn(
                    store,
                    sid,
                    chat,
                    text,
                    max_new_tokens,
                    sampling=sampling,
                    proposer=proposer,
                    draft_length=max(draft_length, 1),
                    cost_model=cost_model,
                )
                switch = (
                    kernel_switched(model, plain_arm[arm])
                    if arm in plain_arm and arm != "plain"
                    else nullcontext()
                )
                with switch:
                    t0 = time.perf_counter()  # the stream computes lazily: this times generation
                    result = collect_reply(turn)
                    seconds = time.perf_counter() - t0
                for step in result.steps:
                    step_rows.append(
                        {
                            "arm": arm,
                            "conversation": conv.id,
                            "turn": ti,
                            "draft_length": step.draft_length,
                            "proposed": step.proposed,
                            "accepted": step.accepted,
                            "emitted": step.emitted,
                            "proposer_s": step.proposer_s,
                            "verifier_s": step.verifier_s,
                            "tree": step.tree,
                        }
                    )
                done = result.done
                turn_rows.append(
                    {
                        "arm": arm,
                        "proposer": arm.split("@")[0]
                        + (" (cost-aware)" if cost_model else "")
                        + (" (padded blocks)" if arms[arm][3] else ""),
                        "draft_length": draft_length,
                        "conversation": conv.id,
                        "turn": ti,
                        "history_len": done.counts.history_len,
                        "generated_tokens": done.counts.generated_tokens,
                        "verifier_forwards": done.counts.verifier_forwards,
                        "proposed": done.counts.proposed,
                        "accepted": done.counts.accepted,
                        "seconds": seconds,
                        "proposer_s": done.timings.proposer_s,
                        "verifier_s": done.timings.verifier_s,
                        "reply_ids": result.token_ids,
                    }
                )
                bar.update(1)
    bar.close()
    turns = pd.DataFrame(turn_rows)
    steps = pd.DataFrame(
        step_rows,
        columns=[
            "arm",
            "conversation",
            "turn",
            "draft_length",
            "proposed",
            "accepted",
            "emitted",
            "proposer_s",
            "verifier_s",
            "tree",
        ],
    )
    turns, plain_kernel, plain_rates = _fastest_plain(turns, plain_arm)
    turns = _add_turn_speedups(turns)
    summary = summarize(turns, steps)
    cost = None
    if probe is not None:
        probe.measure(cost_repeats)
        cost = run_cost_model(probe.timings, probe.context_tokens, summary, steps)
    return SpeculativeRun(
        turns=turns,
        steps=steps,
        summary=summary,
        cost=cost,
        block_padding=plan,
        plain_kernel=plain_kernel,
        plain_tokens_per_s=plain_rates,
    )


def _fastest_plain(
    turns: pd.DataFrame, plain_arm: Mapping[str, str]
) -> tuple[pd.DataFrame, str, dict[str, float]]:
    """Rename the plain arms so ``plain`` is the fastest (tokens/s over the run) and the
    others are ``plain[KERNEL]``; the winner's kernel and every kernel's tokens/s."""
    rates = {}
    for arm, kernel in plain_arm.items():
        rows = turns[turns["arm"] == arm]
        rates[kernel] = float(rows["generated_tokens"].sum() / rows["seconds"].sum())
    fastest = max(rates, key=lambda k: rates[k])
    names = {a: "plain" if k == fastest else f"plain[{k}]" for a, k in plain_arm.items()}
    turns = turns.assign(arm=turns["arm"].map(lambda a: names.get(a, a)))
    rank = turns["arm"].map(lambda a: 0 if a == "plain" else 1 if a.startswith("plain[") else 2)
    turns = turns.iloc[rank.argsort(kind="stable")].reset_index(drop=True)  # plain rows first
    return turns, fastest, rates


def arm_draft_lengths(name: str, draft_lengths: Sequence[int]) -> list[int]:
    """The draft lengths a proposer key runs at: ``SPEC@K`` its own ``K``, else every one
    of ``draft_lengths``."""
    base, at, k = name.rpartition("@")
    if not at:
        return list(draft_lengths)
    if not (base and k.isdigit() and int(k) >= 1):
        raise ValueError(f"bad arm {name!r}: write a fixed draft length like ngram@8")
    return [int(k)]


def _spec_of(name: str) -> str:
    """A proposer key without its fixed draft length (``ngram@8`` -> ``ngram``)."""
    return name.rpartition("@")[0] or name


def _add_turn_speedups(turns: pd.DataFrame) -> pd.DataFrame:
    turns = turns.copy()
    turns["tokens_per_s"] = turns["generated_tokens"] / turns["seconds"]
    turns["tau"] = turns["generated_tokens"] / turns["verifier_forwards"]
    plain = turns[turns["arm"] == "plain"].set_index(["conversation", "turn"])["tokens_per_s"]
    key = list(zip(turns["conversation"], turns["turn"]))
    turns["speedup"] = turns["tokens_per_s"].to_numpy() / plain.reindex(key).to_numpy()
    return turns


def acceptance_by_position(steps: pd.DataFrame, draft_length: int) -> list[float | None]:
    """P(draft position i accepted | it was proposed), for i = 0..draft_length-1."""
    out = []
    for i in range(draft_length):
        proposed = steps[steps["proposed"] > i]
        out.append(float((proposed["accepted"] > i).mean()) if len(proposed) else None)
    return out


def summarize(turns: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """One row per arm with the metrics of `docs/design.md` (see module docstring)."""
    plain = turns[turns["arm"] == "plain"]
    plain_tps = plain["generated_tokens"].sum() / plain["seconds"].sum()
    plain_s_per_token = plain["verifier_s"].sum() / plain["verifier_forwards"].sum()
    rows = []
    for arm, df in turns.groupby("arm", sort=False):
        tokens, seconds = df["generated_tokens"].sum(), df["seconds"].sum()
        row = {
            "arm": arm,
            "proposer": df["proposer"].iloc[0],
            "draft_length": int(df["draft_length"].iloc[0]),
            "turns": len(df),
            "generated_tokens": int(tokens),
            "tokens_per_s": tokens / seconds,
            "tau": tokens / df["verifier_forwards"].sum(),
            "speedup": (tokens / seconds) / plain_tps,
            "proposer_s": df["proposer_s"].sum(),
            "verifier_s": df["verifier_s"].sum(),
            "acceptance_rate": None,
            "acceptance_probability": None,
            "draft_cost_ratio": None,
            "expected_speedup": None,
            "acceptance_by_position": None,
            "zero_accept_rate": None,
        }
        s = steps[steps["arm"] == arm]
        if arm != "plain" and len(s) and s["proposed"].sum() > 0:
            accepted, proposed = s["accepted"].sum(), s["proposed"].sum()
            rejections = (s["accepted"] < s["proposed"]).sum()
            probability = accepted / (accepted + rejections) if accepted + rejections else None
            cost_ratio = (s["proposer_s"].sum() / proposed) / plain_s_per_token
            if "tree" in s and bool(s["tree"].any()):
                probability = None  # Leviathan's formula describes chains, not trees
            row.update(
                acceptance_rate=accepted / proposed,
                acceptance_probability=probability,
                draft_cost_ratio=cost_ratio,
                expected_speedup=leviathan_speedup(probability, row["draft_length"], cost_ratio)
                if probability is not None
                else None,
                acceptance_by_position=acceptance_by_position(s, row["draft_length"]),
                zero_accept_rate=float((s.loc[s["proposed"] > 0, "accepted"] == 0).mean()),
            )
        rows.append(row)
    return pd.DataFrame(rows)


def arm_lossless(turns: pd.DataFrame) -> dict[str, bool]:
    """Per arm: whether it emitted exactly the plain arm's tokens on every turn."""
    plain = turns[turns["arm"] == "plain"].set_index(["conversation", "turn"])["reply_ids"]
    out: dict[str, bool] = {}
    for arm, df in turns.groupby("arm", sort=False):
        out[str(arm)] = all(
            list(r.reply_ids) == list(plain[(r.conversation, r.turn)]) for r in df.itertuples()
        )
    return out


def greedy_streams_identical(turns: pd.DataFrame) -> bool:
    """True if every arm emitted exactly the plain arm's tokens on every turn (greedy)."""
    return all(arm_lossless(turns).values())


def hf_assisted_generation(
    target, draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 64
) -> AssistedGeneration:
    """transformers' own assisted generation vs its own plain greedy ``generate`` (stock
    SDPA attention, growing DynamicCache), on the same prompts, side by side.

    A reference point printed beside our speedup; not our decoder. ``speedup`` is assisted
    tokens/s ÷ plain tokens/s of transformers' loop.
    """
    import torch

    from kakeya_lab.backends.torch_attention import standard_attention

    plain_tokens = assisted_tokens = 0
    plain_s = assisted_s = 0.0
    identical = True
    with standard_attention(target), standard_attention(draft), torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([list(ids)])
            common = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            t0 = time.perf_counter()
            plain = target.generate(x, **common)
            plain_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            assisted = target.generate(x, assistant_model=draft, **common)
            assisted_s += time.perf_counter() - t0
            plain_tokens += plain.shape[1] - x.shape[1]
            assisted_tokens += assisted.shape[1] - x.shape[1]
            identical &= bool(torch.equal(plain, assisted))
    return AssistedGeneration(
        plain_tokens_per_s=plain_tokens / plain_s,
        assisted_tokens_per_s=assisted_tokens / assisted_s,
        speedup=(assisted_tokens / assisted_s) / (plain_tokens / plain_s),
        identical_output=identical,
    )
