"""Speculative decoding: losslessness, distribution preservation, rollback, bad input."""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import replace

import pandas as pd
import pytest
import torch
from oracle_cases import SMALL_VOCAB, small_vocab_model
from scipy.stats import chisquare

from kakeya_lab import SinkWindowConfig, Verifier, reference
from kakeya_lab.proposers import (
    Draft,
    DraftModelProposer,
    EarlyExitProposer,
    NgramProposer,
    TokenizerMismatch,
    make_proposer,
)
from kakeya_lab.sampling import SamplingConfig, sampling_probs
from kakeya_lab.session import SessionStore, SpeculativeStep, Token
from kakeya_lab.speculative import (
    accept_sampled,
    plain_decode,
    speculative_decode,
)

MAX_NEW = 40


def _plain(model, config, prompt, max_new=MAX_NEW):
    v = Verifier(model, config)
    return list(plain_decode(v, v.append(prompt), max_new_tokens=max_new)), v


def _spec(model, config, prompt, proposer, draft_length, max_new=MAX_NEW, **kw):
    v = Verifier(model, config)
    decoder = speculative_decode(
        v, v.append(prompt), proposer, max_new_tokens=max_new, draft_length=draft_length, **kw
    )
    out = list(decoder)
    tokens = [t for t in out if not isinstance(t, SpeculativeStep)]
    steps = [s for s in out if isinstance(s, SpeculativeStep)]
    return tokens, steps, v, decoder


PROPOSERS = ["ngram", "self-draft", "tiny-draft", "early-exit"]


def _proposer(kind, default_model, tiny_model, config):
    model, tok = default_model.model, default_model.tokenizer
    if kind == "ngram":
        return NgramProposer()
    if kind == "self-draft":  # the verifier drafting for itself: every draft accepted
        return DraftModelProposer(model, config, tokenizer=tok, verifier_tokenizer=tok)
    if kind == "tiny-draft":  # an unrelated random model: most drafts rejected
        return DraftModelProposer(
            tiny_model.model, config, tokenizer=tiny_model.tokenizer, verifier_tokenizer=tok
        )
    return EarlyExitProposer(model, config, num_layers=6)


@pytest.fixture(scope="module")
def plain_runs(default_model, text_ids):
    """Plain greedy decoding per position mode, computed once."""
    runs = {}
    for mode in ("global", "rolling"):
        config = SinkWindowConfig(sink=4, window=36, positions=mode)
        prompt = text_ids[:70]  # longer than the budget: eviction during prefill and decode
        runs[mode] = (config, prompt, _plain(default_model.model, config, prompt)[0])
    return runs


def _lossless_cases():
    """Every (mode, proposer, draft length)."""
    for mode in ("global", "rolling"):
        for kind in PROPOSERS:
            for draft_length in (1, 4, 8):
                yield pytest.param(mode, kind, draft_length, id=f"{draft_length}-{kind}-{mode}")


@pytest.mark.parametrize(("mode", "kind", "draft_length"), list(_lossless_cases()))
@pytest.mark.slow
def test_greedy_is_lossless(plain_runs, default_model, tiny_model, mode, kind, draft_length):
    config, prompt, want = plain_runs[mode]
    proposer = _proposer(kind, default_model, tiny_model, config)
    got, steps, v, state = _spec(default_model.model, config, prompt, proposer, draft_length)
    assert got == want
    assert v.history_token_ids == prompt + want  # everything emitted is committed
    assert v.cache_len == config.budget
    assert len(steps) + 1 == state.verifier_forwards
    if kind == "self-draft":
        assert all(s.accepted == s.proposed for s in steps)  # drafts equal the verifier's
        if draft_length > 1:
            assert len(want) / state.verifier_forwards > 1.5


@pytest.mark.slow
def test_speculative_session_matches_plain_across_turns(default_model):
    """Through the session runtime, over several chat turns, past the window."""
    from kakeya_lab.chat import ChatTemplate

    model, tok = default_model.model, default_model.tokenizer
    config = SinkWindowConfig(sink=4, window=48)
    outputs = {}
    for label, proposer in (
        ("plain", None),
        ("ngram", NgramProposer()),
        ("early", EarlyExitProposer(model, config, num_layers=8)),
    ):
        store = SessionStore(model, config)
        sid = store.create()
        chat = ChatTemplate(tok)
        toks = []
        for user in ["Hi there!", "Name three colours.", "And three more?"]:
            store.append(sid, chat.user(user))
            events = list(store.generate(sid, 16, proposer=proposer, draft_length=4))
            reply = [e.id for e in events if isinstance(e, Token)]
            chat.generated(reply, eos_token_ids=store.eos_token_ids)
            toks += reply
            if proposer is not None:
                assert any(isinstance(e, SpeculativeStep) for e in events)
        outputs[label] = toks
        info = store.info(sid)
        assert info.history_len > config.budget
        if proposer is not None:
            assert info.speculative.steps > 0 and info.speculative.tau >= 1.0
    assert outputs["ngram"] == outputs["plain"]
    assert outputs["early"] == outputs["plain"]


@pytest.mark.slow  # loads the default model's int4 copy: the full suite runs it
def test_a_draft_of_the_verifiers_own_weights_copies_each_prompt(default_model):
    """A ``draft:`` model loaded from the verifier's own weights (its int4 copy: the same
    weight sha256) takes each user turn into its cache as the verifier's keys and values
    rather than reading it again; over several turns past both windows (the first prompt
    longer than the draft's window, so only what the draft keeps is copied) the stream is
    plain decoding's, and a draft of other weights reads its prompts itself."""
    from kakeya_lab import load_model
    from kakeya_lab.chat import ChatTemplate

    model, tok = default_model.model, default_model.tokenizer
    config = SinkWindowConfig(sink=4, window=48)
    sha = default_model.description.weight_sha256
    own = load_model(default_model.description.name, dtype=torch.float32, linear="int4")
    assert own.description.weight_sha256 == sha
    long_user = " ".join(["Tell me about the sea, the ships and the harbour."] * 8)
    outputs = {}
    for label, proposer in (
        ("plain", None),
        (
            "own",
            make_proposer("draft:own", model, config, tok, draft_model=own, verifier_sha256=sha),
        ),
        ("other", make_proposer("draft:own", model, config, tok, draft_model=own)),
    ):
        store = SessionStore(model, replace(config, window=64))
        sid = store.create()
        chat = ChatTemplate(tok)
        toks = []
        for user in [long_user, "Name three colours.", "And three more?"]:
            store.append(sid, chat.user(user))
            events = list(store.generate(sid, 16, proposer=proposer, draft_length=4))
            reply = [e.id for e in events if isinstance(e, Token)]
            chat.generated(reply, eos_token_ids=store.eos_token_ids)
            toks += reply
        outputs[label] = (toks, proposer)
        assert store.info(sid).history_len > 64
    assert outputs["own"][0] == outputs["plain"][0] == outputs["other"][0]
    own_proposer, other = outputs["own"][1], outputs["other"][1]
    assert own_proposer.describe()["prompt"] == "copied from the verifier"
    assert own_proposer.copied_tokens > len(long_user.split())  # every turn's prompt
    assert other.describe()["prompt"] == "forwarded" and other.copied_tokens == 0


@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_copied_entries_are_what_a_forward_leaves(tiny_model, mode):
    """A cache given another cache's entries of the same model (``Verifier.append_copied``)
    holds what appending them would hold and then steps to the oracle's logits, also when
    the source no longer holds the ones it evicts (a prompt past the window); when the
    source lacks one it would keep, or another history stands there, nothing changes."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=10, positions=mode)
    rng = random.Random(3)
    ids = [rng.randrange(1000, 30000) for _ in range(60)]
    source = Verifier(model, config)
    source.append(ids[:30])  # holds the sinks and the last 10: 0, 1, 20..29
    copied = Verifier(model, config)
    assert copied.append_copied(source, ids[:30])
    appended = Verifier(model, config)
    appended.append(ids[:30])
    assert copied.history_token_ids == appended.history_token_ids == ids[:30]
    assert copied.cached_positions() == appended.cached_positions() == [0, 1, *range(20, 30)]
    got = torch.stack([copied.append([t]) for t in ids[30:45]])
    want = reference.oracle_logits(model, ids[:45], config)[30:]
    assert (got - want).abs().max().item() <= 1e-4
    half = Verifier(copy.deepcopy(model).to(torch.bfloat16), config)  # storage in its dtype
    assert half.append_copied(source, ids[:30])
    assert half.backend.cache.sink_window_layers[0].storage()[0].dtype == torch.bfloat16
    assert int(half.append([ids[30]]).argmax()) == int(want[0].argmax())
    wider = Verifier(model, replace(config, window=20))  # would keep 10..19, evicted there
    later = Verifier(model, config)
    source.append(ids[30:35])  # now holds 25..34: the copy's 20..24 are gone
    other = Verifier(model, config)
    for verifier, tokens in ((wider, ids[:30]), (later, ids[:30]), (other, ids[1:31])):
        assert not verifier.append_copied(source, tokens)
        assert (verifier.history_len, verifier.cache_len, verifier.pending_len) == (0, 0, 0)
        assert verifier.backend.next_position == 0


# ----------------------------------------------------------- rejection sampling
VOCAB = SMALL_VOCAB
SAMPLED = SamplingConfig(temperature=1.0)


def _broken_accept(rows, draft, sampling, generator):
    """Wrong on purpose: on rejection it resamples from p instead of max(0, p - q)."""
    for i, d in enumerate(draft.tokens):
        p = sampling.probs(rows[i])
        q = draft.probs[i]
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[d] / q[d])):
            continue
        return i, int(torch.multinomial(p, 1, generator=generator))
    p = sampling.probs(rows[len(draft.tokens)])
    return len(draft.tokens), int(torch.multinomial(p, 1, generator=generator))


def _first_two_tokens_test(accept, samples=20000):
    """Chi-square p-value of the first two tokens emitted after x under speculation,
    against the verifier's exact joint distribution."""
    target, draft_model = small_vocab_model(1), small_vocab_model(2)
    config = SinkWindowConfig(sink=2, window=6)
    prompt, x = [1, 5, 2, 7, 3, 0, 6, 4], 3
    context = prompt + [x]
    t_logits = reference.dense_logits(target, context, config)
    # exact rows of the verifier and the draft model for every (d1, d2) block
    rows, qrows = {}, {}
    for d1 in range(VOCAB):
        for d2 in range(VOCAB):
            v = Verifier(target, config)
            v.append(prompt)
            rows[d1, d2] = v.forward_block([x, d1, d2])
        dv = Verifier(draft_model, config)
        qrows[d1] = dv.append(context + [d1])
    q0 = sampling_probs(Verifier(draft_model, config).append(context), temperature=1.0)
    assert (rows[0, 0][0] - t_logits[-1]).abs().max() < 1e-4
    gen = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(samples):
        d1 = int(torch.multinomial(q0, 1, generator=gen))
        q1 = sampling_probs(qrows[d1], temperature=1.0)
        d2 = int(torch.multinomial(q1, 1, generator=gen))
        draft = Draft([d1, d2], torch.stack([q0, q1]), 0.0)
        n, nxt = accept(rows[d1, d2], draft, SAMPLED, gen)
        emitted = ([d1, d2][:n] + [nxt])[:2]
        if len(emitted) < 2:  # rejected at once: the second token comes from the next step
            first = emitted[0]
            q1 = sampling_probs(qrows[first], temperature=1.0)
            d = int(torch.multinomial(q1, 1, generator=gen))
            block_rows = rows[first, d][1:]  # after x+first, then after x+first+d
            n2, nxt2 = accept(block_rows, Draft([d], q1[None], 0.0), SAMPLED, gen)
            emitted.append(d if n2 else nxt2)
        counts[tuple(emitted)] += 1
    p1 = sampling_probs(rows[0, 0][0], temperature=1.0)
    expected = []
    observed = []
    for a in range(VOCAB):
        p2 = sampling_probs(rows[a, 0][1], temperature=1.0)
        for b in range(VOCAB):
            expected.append(float(p1[a] * p2[b]) * samples)
            observed.append(counts[a, b])
    keep = [i for i, e in enumerate(expected) if e >= 5]
    exp = torch.tensor([expected[i] for i in keep], dtype=torch.float64)
    obs = torch.tensor([observed[i] for i in keep], dtype=torch.float64)
    exp = exp * obs.sum() / exp.sum()
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.slow
def test_rejection_sampling_preserves_the_distribution():
    assert _first_two_tokens_test(accept_sampled) > 1e-3


@pytest.mark.slow
def test_the_distribution_check_catches_a_wrong_residual():
    assert _first_two_tokens_test(_broken_accept) < 1e-6


# ------------------------------------------------------------ rollback / caches
@pytest.mark.slow
def test_verifier_and_proposer_caches_stay_consistent(tiny_model):
    """A thousand random accept lengths: both caches equal a fresh replay and the oracle."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=12)
    proposer = DraftModelProposer(model, config)
    v = Verifier(model, config)
    rng = random.Random(7)
    v.append([rng.randrange(v.vocab_size) for _ in range(5)])
    x = rng.randrange(v.vocab_size)
    accepts = 0
    while accepts < 1000:
        length = rng.randint(1, 5)
        draft = proposer.propose(v.history_token_ids + [x], length, SamplingConfig())
        v.forward_block([x] + draft.tokens)
        n = rng.randint(0, length)
        v.commit(1 + n)
        proposer.accept(n)
        accepts += 1
        x = rng.randrange(v.vocab_size)  # the "verifier token" after the accepted drafts
    assert v.history_len > 10 * config.budget
    fresh = Verifier(model, config)
    fresh.append(v.history_token_ids)
    assert fresh.cached_token_ids == v.cached_token_ids
    probe = [x, 3, 4]
    want = reference.dense_logits(model, v.history_token_ids + probe, config)[-3:]
    assert (v.forward_block(probe) - want).abs().max().item() <= 1e-4
    v.rollback()
    # the proposer's cache: committed drafts only, consistent with the context it saw
    ph = proposer.verifier.history_token_ids
    assert ph == v.history_token_ids[: len(ph)]
    assert len(v.history_token_ids) - len(ph) <= 2
    pf = Verifier(model, config)
    pf.append(ph)
    assert pf.cached_token_ids == proposer.verifier.cached_token_ids


# ------------------------------------------------------------------- bad input
def test_bad_arguments_are_clear_errors(default_model, tiny_model):
    model, tok = default_model.model, default_model.tokenizer
    config = SinkWindowConfig(sink=4, window=28)
    store = SessionStore(model, config)
    sid = store.create()
    store.append(sid, [1, 2, 3])
    with pytest.raises(ValueError, match="draft_length must be"):
        store.generate(sid, 4, proposer=NgramProposer(), draft_length=0)
    with pytest.raises(ValueError, match="temperature"):
        store.generate(sid, 4, SamplingConfig(temperature=-0.5), proposer=NgramProposer())
    other = copy.deepcopy(tok)
    other.add_tokens(["<an-extra-token>"])
    with pytest.raises(TokenizerMismatch, match="tokenizer"):
        DraftModelProposer(tiny_model.model, config, tokenizer=other, verifier_tokenizer=tok)
    with pytest.raises(ValueError):
        EarlyExitProposer(model, config, num_layers=30)
    with pytest.raises(ValueError):
        NgramProposer(ngram_sizes=[0])
    assert store.info(sid).history_len == 3


def test_ngram_proposer_looks_up_the_latest_match():
    p = NgramProposer(ngram_sizes=(2, 1))
    assert p.propose([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3).tokens == [4, 5, 1]
    assert p.propose([7, 8], 3).tokens == []
    assert p.propose([5, 6, 5], 2).tokens == [6, 5]


@pytest.mark.slow
def test_adaptive_draft_length_stays_lossless(plain_runs, default_model):
    config, prompt, want = plain_runs["global"]
    got, steps, _, _ = _spec(
        default_model.model,
        config,
        prompt,
        NgramProposer(),
        draft_length=3,
        adaptive_draft_length=True,
    )
    assert got == want
    assert len({s.draft_length for s in steps if s.draft_length}) > 1  # the length actually moved


def test_make_proposer_uses_an_already_loaded_draft_model(default_model, tiny_model):
    config = SinkWindowConfig(sink=4, window=28)
    proposer = make_proposer(
        "draft:tiny", default_model.model, config, default_model.tokenizer, draft_model=tiny_model
    )
    assert isinstance(proposer, DraftModelProposer) and proposer.model is tiny_model.model
    assert proposer.describe()["model"] == "tiny"
    assert make_proposer("none", default_model.model, config) is None
    # a bare PreTrainedModel, as documented: the network itself, not its base model
    bare = make_proposer("draft:tiny", default_model.model, config, draft_model=tiny_model.model)
    assert bare.model is tiny_model.model
    assert len(bare.propose([1, 2, 3], 2).tokens) == 2


# ---------------------------------------------------------------- the benchmark's records


def test_leviathan_speedup_at_its_known_points():
    from kakeya_lab.bench.speculative import leviathan_speedup

    # one free draft accepted with probability p emits 1 + p tokens per verifier step
    assert leviathan_speedup(0.5, draft_length=1, draft_cost_ratio=0.0) == pytest.approx(1.5)
    # every draft accepted: draft_length + 1 tokens per step, each drafted token costing c
    assert leviathan_speedup(1.0, draft_length=4, draft_cost_ratio=0.25) == pytest.approx(2.5)
    # never accepted: one token per step, paying for the drafts
    assert leviathan_speedup(0.0, draft_length=3, draft_cost_ratio=0.1) == pytest.approx(1 / 1.3)


@pytest.mark.slow
def test_benchmark_records_name_draft_length_acceptance_and_cost(default_model):
    from kakeya_lab.bench.speculative import leviathan_speedup, run_speculative
    from kakeya_lab.bench.speculative_settings import SpeculativeSettings
    from kakeya_lab.data import chitchat_conversations

    run = run_speculative(
        default_model,
        {"ngram": NgramProposer},
        chitchat_conversations("dev", limit=1, min_turns=2),
        SpeculativeSettings.for_cache(
            SinkWindowConfig(sink=4, window=60), draft_lengths=(3,), turns=1, max_new_tokens=10
        ),
        progress=False,
    )
    assert {"draft_length", "proposed", "accepted"} <= set(run.steps.columns)
    turns = run.turns.set_index("arm")
    assert turns.loc["plain", "draft_length"] == 0 and turns.loc["ngram@3", "draft_length"] == 3
    s = run.summary.set_index("arm")
    assert pd.isna(s.loc["plain", "acceptance_probability"])  # nothing drafted, nothing measured
    row, steps = s.loc["ngram@3"], run.steps[run.steps["arm"] == "ngram@3"]
    length = 3
    assert row["draft_length"] == length
    assert steps["draft_length"].max() <= length  # shorter near the reply's token budget
    assert len(row["acceptance_by_position"]) == length
    assert steps["proposed"].sum() > 0  # the chat template repeats itself: lookup drafts
    assert row["acceptance_rate"] == steps["accepted"].sum() / steps["proposed"].sum()
    assert 0.0 <= row["acceptance_probability"] <= 1.0 and row["draft_cost_ratio"] > 0
    assert row["expected_speedup"] == pytest.approx(
        leviathan_speedup(row["acceptance_probability"], length, row["draft_cost_ratio"])
    )
