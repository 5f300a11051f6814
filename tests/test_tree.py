"""Draft trees: tree-verify logits and non-prefix commits against the dense masked oracle
across eviction, greedy tree speculation equal to plain decoding, rejection sampling over
trees, bad input."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from oracle_cases import SMALL_VOCAB, small_vocab_model
from scipy.stats import chisquare

from kakeya_lab import SinkWindowConfig, Verifier, reference
from kakeya_lab.proposers import ChainTree, DraftModelProposer, NgramProposer, make_proposer
from kakeya_lab.proposers.trees import NgramTreeProposer, SuffixTreeProposer
from kakeya_lab.sampling import SamplingConfig, sampling_probs
from kakeya_lab.session import SpeculativeStep
from kakeya_lab.speculative import (
    accept_greedy_tree,
    accept_sampled_tree,
    plain_decode,
    speculative_decode,
)
from kakeya_lab.tree import DraftTree

CODE = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
) * 3


def _random_tree(rng: random.Random, vocab: int, n: int) -> DraftTree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    tokens, used = [], set()
    for p in parents:
        t = rng.randrange(vocab)
        while (p, t) in used:
            t = rng.randrange(vocab)
        used.add((p, t))
        tokens.append(t)
    return DraftTree(tokens, parents)


def _tree_against_oracle(model, v: Verifier, tree: DraftTree) -> float:
    """Worst max-abs difference between each node's tree-verify row and the oracle's
    next-token logits after ``history + path(node)``."""
    rows = v.forward_tree(tree)
    worst = 0.0
    history = v.history_token_ids
    root = reference.RollingReference(model, v.config)
    refs: list[reference.RollingReference] = []  # rolling: each node's state, from its parent's
    if v.config.positions == "rolling" and history:
        root.extend(history)
    for i, parent in enumerate(tree.parents):
        if v.config.positions == "global":
            path = [tree.tokens[j] for j in tree.path(i)]
            want = reference.dense_logits(model, history + path, v.config)[-1]
        else:
            refs.append((root if parent < 0 else refs[parent]).copy())
            want = refs[i].extend([tree.tokens[i]])[-1]
        worst = max(worst, (rows[i] - want).abs().max().item())
    return worst


# ------------------------------------------------------------ (a) + (b): mechanics
@pytest.mark.parametrize("mode", ["global", "rolling"])
@pytest.mark.slow
def test_tree_rows_and_non_prefix_commits_match_the_oracle(
    tiny_model, tiny_on, backend, mode, record_tolerance
):
    """Random trees (some deeper than the window) over a history that wraps the window
    many times: every node's row equals the (torch) oracle of its root path; a random
    root-to-node path (mostly not a storage prefix) is committed, and the next tree's
    rows check the cache after it; finally a fresh replay holds the same entries."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=6, positions=mode)
    rng = random.Random(11 if mode == "global" else 12)
    v = Verifier(tiny_on("qwen3", backend), config)
    vocab = v.vocab_size
    v.append([rng.randrange(vocab) for _ in range(3)])
    worst, non_prefix, lean_trees = 0.0, 0, 0
    for _ in range(30):
        tree = _random_tree(rng, vocab, rng.randint(1, 12))
        steps = getattr(v.backend, "lean_steps", 0)
        worst = max(worst, _tree_against_oracle(model, v, tree))
        lean_trees += getattr(v.backend, "lean_steps", 0) - steps
        path = tree.path(rng.randrange(len(tree)))
        non_prefix += path != list(range(len(path)))
        v.commit_path(path)
        assert v.pending_len == 0 and v.cache_len <= config.budget
        if rng.random() < 0.3:
            v.append([rng.randrange(vocab) for _ in range(rng.randint(1, 4))])
    assert v.history_len > 5 * config.budget, "the run must wrap the window many times"
    assert non_prefix >= 10
    assert lean_trees == (30 if backend == "torch" else 0)  # torch: every tree ran lean
    record_tolerance(f"tiny-qwen3/{backend}/{mode}/tree rows and non-prefix commits", worst)
    assert worst <= 1e-4
    fresh = Verifier(tiny_on("qwen3", backend), config)
    fresh.append(v.history_token_ids)
    assert fresh.cached_token_ids == v.cached_token_ids
    assert fresh.cached_positions() == v.cached_positions()
    probe = [rng.randrange(vocab) for _ in range(4)]
    diff = (v.forward_block(probe) - fresh.forward_block(probe)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("mode", ["global", "rolling"])
def test_a_deep_tree_over_an_empty_history_matches_the_oracle(tiny_model, tiny_on, backend, mode):
    """The block holds the sinks itself and is far deeper than sink + window, so in
    rolling mode its deep nodes need rotated copies of sink *block* columns, each query
    seeing only the copies of its own ancestors. On torch through both forwards: the lean
    one (the default; its counter shows it ran) and transformers' (``lean=False``)."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=4, positions=mode)
    for lean in (None, False) if backend == "torch" else (None,):
        rng = random.Random(1)
        worst = 0.0
        for _ in range(4):
            v = Verifier(tiny_on("qwen3", backend), config, lean=lean)
            n = 14
            parents = [-1, 0, 0] + [
                i - 1 if rng.random() < 0.7 else rng.randrange(1, i) for i in range(3, n)
            ]
            tokens = rng.sample(range(v.vocab_size), n)  # distinct: no repeated siblings
            tree = DraftTree(tokens, parents)
            assert tree.depth > config.sink + config.window
            worst = max(worst, _tree_against_oracle(model, v, tree))
            v.commit_path(tree.path(n - 1))
            tree = _random_tree(rng, v.vocab_size, 8)
            worst = max(worst, _tree_against_oracle(model, v, tree))
            if backend == "torch":
                assert v.backend.lean_steps == (2 if lean is None else 0)
        assert worst <= 1e-4


@pytest.mark.parametrize("mode", ["global", pytest.param("rolling", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_tree_rows_match_the_oracle_on_the_default_model(default_model, text_ids, mode):
    """The default SmolLM2 past eviction: a branching tree's rows, then a non-prefix commit."""
    model = default_model.model
    config = SinkWindowConfig(sink=4, window=20, positions=mode)
    v = Verifier(model, config)
    v.append(text_ids[:70])
    tree = DraftTree(text_ids[70:76] + [11, 12], [-1, 0, 1, 2, 3, 4, -1, 6])
    assert _tree_against_oracle(model, v, tree) <= 1e-3
    v.commit_path([6, 7])
    probe = text_ids[80:83]
    got = v.forward_block(probe)
    seq = v.history_token_ids + probe
    assert v.history_token_ids[-2:] == [11, 12]
    want = reference.oracle_logits(model, seq, config)[-3:]
    assert (got - want).abs().max().item() <= 1e-3


# ------------------------------------------------------------ (c): lossless greedy
@pytest.fixture(scope="module")
def code_prompt(default_model):
    return default_model.tokenizer(CODE, add_special_tokens=False)["input_ids"]


class _DecoyTree:
    """A tree proposer that knows the right continuation (plain decoding's output) and
    stores a wrong sibling before the right token at every depth, so every accepted path
    is *not* a prefix of the block's storage order."""

    name = "decoy_tree"

    def __init__(self, prompt: list[int], answer: list[int], vocab: int):
        self.full = prompt + answer
        self.vocab = vocab

    def propose(self, context, draft_length, sampling=None, generator=None):
        raise NotImplementedError("tree only")

    def propose_tree(self, context, max_nodes, sampling=None, generator=None) -> DraftTree:
        n = len(context)
        right = self.full[n : n + max_nodes // 2]
        tokens, parents, parent = [], [], -1
        for t in right:
            tokens += [(t + 1) % self.vocab, t]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftTree(tokens, parents)

    def accept(self, n: int) -> None:
        return None

    def describe(self) -> dict:
        return {"name": self.name}


def _decode(model, config, prompt, proposer, draft_length=10, max_new=40, **kw):
    v = Verifier(model, config)
    if proposer is None:
        return list(plain_decode(v, v.append(prompt), max_new_tokens=max_new)), [], v
    decoder = speculative_decode(
        v, v.append(prompt), proposer, max_new_tokens=max_new, draft_length=draft_length, **kw
    )
    out = list(decoder)
    tokens = [t for t in out if not isinstance(t, SpeculativeStep)]
    return tokens, [s for s in out if isinstance(s, SpeculativeStep)], v


@pytest.fixture(scope="module")
def plain_code_runs(default_model, code_prompt):
    runs = {}
    for mode in ("global", "rolling"):
        config = SinkWindowConfig(sink=4, window=20, positions=mode)  # prompt ~5x the budget
        runs[mode] = (config, _decode(default_model.model, config, code_prompt, None)[0])
    return runs


def _tree_cases():
    for mode in ("global", "rolling"):
        specs = ("ngram-tree", "suffix-tree", "suffix-tree+adaptive", "tree:ngram", "decoy")
        for spec in (*specs, "tree:early-exit:6"):
            fast = spec != "tree:early-exit:6" and (mode == "global" or spec == "decoy")
            yield pytest.param(
                mode, spec, marks=() if fast else pytest.mark.slow, id=f"{spec}-{mode}"
            )


@pytest.mark.parametrize(("mode", "spec"), list(_tree_cases()))
@pytest.mark.slow
def test_greedy_tree_speculation_equals_plain_decoding(
    default_model, code_prompt, plain_code_runs, mode, spec
):
    model = default_model.model
    config, want = plain_code_runs[mode]
    if spec == "decoy":
        proposer = _DecoyTree(code_prompt, want, model.config.vocab_size)
    else:
        proposer = make_proposer(spec.split("+")[0], model, config, default_model.tokenizer)
    options = {"adaptive_draft_length": True} if spec.endswith("+adaptive") else {}
    got, steps, v = _decode(model, config, code_prompt, proposer, **options)
    assert got == want
    assert v.history_token_ids == code_prompt + want
    assert v.cache_len == config.budget
    if "early-exit" not in spec:  # 6 of 30 layers may draft nothing right on a short run
        assert sum(s.accepted for s in steps) > 0
    if spec == "decoy":  # every step accepts the whole right path (5 tokens, the last short)
        assert all(s.accepted == min(5, s.draft_length // 2) for s in steps)


# ------------------------------------------------------------ proposers
def test_tree_proposers_branch_and_contain_the_chain_draft():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3, 7, 5, 1, 2, 3]
    tree = NgramTreeProposer().propose_tree(context, 16)
    chain = NgramProposer().propose(context, 16).tokens
    # continuations of (1, 2, 3): 7 twice (latest first), then 9; best-first by count
    assert [tree.tokens[i] for i in tree.children(-1)] == [7, 9]
    assert tree.tokens[0] == 7
    assert [tree.tokens[i] for i in tree.path(len(chain) - 1)] == chain  # stored first
    # the 3-gram occurs once; the 1-gram (3,) adds a second branch after the chain's path
    context2 = [5, 1, 2, 3, 4, 9, 3, 8, 1, 2, 3]
    tree2 = NgramTreeProposer().propose_tree(context2, 16)
    chain2 = NgramProposer().propose(context2, 16).tokens
    assert list(tree2.tokens[: len(chain2)]) == chain2 == [4, 9, 3, 8, 1, 2, 3]
    assert [tree2.tokens[i] for i in tree2.children(-1)] == [4, 8]
    small = NgramTreeProposer().propose_tree(context, 3)
    assert len(small) == 3
    suffix = SuffixTreeProposer(min_probability=0.05).propose_tree(context, 10)
    assert len(suffix.children(-1)) >= 2 and len(suffix) <= 10
    roots = [suffix.tokens[i] for i in suffix.children(-1)]
    assert roots[0] == 7
    one_wide = ChainTree(NgramProposer()).propose_tree(context, 4)
    assert one_wide.parents == tuple(range(-1, len(one_wide) - 1))


def test_make_proposer_tree_specs(tiny_model):
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=6)
    assert isinstance(make_proposer("ngram-tree:2,1", model, config), NgramTreeProposer)
    assert isinstance(make_proposer("suffix-tree:6", model, config), SuffixTreeProposer)
    wrapped = make_proposer("tree:ngram", model, config)
    assert isinstance(wrapped, ChainTree) and wrapped.name == "tree:ngram"
    for bad in ("tree:", "tree:ngram-tree", "suffix-tree:x", "ngram-tree:a"):
        with pytest.raises(ValueError):
            make_proposer(bad, model, config)


# ------------------------------------------------------------ (d): bad input
def test_malformed_trees_are_clear_errors():
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree([5, 6], [1, -1])  # parent after child
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree([5], [0])  # a node its own parent (a cycle)
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree([5, 6], [1, 0])  # a two-node cycle
    with pytest.raises(ValueError, match="one parent per token"):
        DraftTree([5, 6], [-1])
    with pytest.raises(ValueError, match="repeats token"):
        DraftTree([5, 5], [-1, -1])
    with pytest.raises(ValueError, match="negative"):
        DraftTree([-3], [-1])
    with pytest.raises(TypeError):
        DraftTree([1.5], [-1])
    with pytest.raises(ValueError, match="1-wide"):
        DraftTree([1, 2], [-1, -1], torch.ones(2, 4))


def test_bad_trees_and_paths_leave_the_verifier_unchanged(tiny_model):
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=6)
    v = Verifier(model, config)
    rng = random.Random(3)
    v.append([rng.randrange(v.vocab_size) for _ in range(20)])
    before = (v.history_token_ids, v.cached_token_ids, v.cached_positions())
    keys = [layer.keys[:, :, : v.cache_len].clone() for layer in v.cache.layers]

    def unchanged() -> bool:
        return (v.history_token_ids, v.cached_token_ids, v.cached_positions()) == before and all(
            torch.equal(layer.keys[:, :, : v.cache_len], k)
            for layer, k in zip(v.cache.layers, keys)
        )

    with pytest.raises(ValueError, match="empty"):
        v.forward_tree(DraftTree.empty())
    with pytest.raises(ValueError):
        v.forward_tree(DraftTree([1, v.vocab_size], [-1, 0]))
    with pytest.raises(TypeError):
        v.forward_tree([1, 2])  # type: ignore[arg-type]
    assert unchanged() and v.pending_len == 0
    tree = DraftTree([1, 2, 3, 4], [-1, 0, -1, 2])
    rows = v.forward_tree(tree)
    with pytest.raises(RuntimeError, match="draft tree is open"):
        v.forward_block([5])
    with pytest.raises(RuntimeError, match="provisional block"):
        v.forward_tree(tree)
    for bad in ([1], [0, 2], [2, 1], [0, 1, 3], [7]):
        with pytest.raises(ValueError, match="not a root-to-node path"):
            v.commit_path(bad)
        assert unchanged() and v.pending_len == 4
    v.commit_path([2, 3])
    assert v.history_token_ids == before[0] + [3, 4]
    want = reference.dense_logits(model, before[0] + [3, 4], config)[-1]
    assert (rows[3] - want).abs().max().item() <= 1e-4


class _OutOfVocabTree:
    name = "out_of_vocab_tree"

    def __init__(self, vocab: int):
        self.vocab = vocab

    def propose(self, context, draft_length, sampling=None, generator=None):
        raise NotImplementedError("tree only")

    def propose_tree(self, context, max_nodes, sampling=None, generator=None) -> DraftTree:
        return DraftTree([1, self.vocab + 3], [-1, -1])

    def accept(self, n: int) -> None:
        return None

    def describe(self) -> dict:
        return {"name": self.name}


def test_a_proposer_returning_a_bad_tree_loses_nothing(tiny_model):
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=6)
    v = Verifier(model, config)
    v.append([5, 6, 7])
    decoder = speculative_decode(
        v, v.append([8]), _OutOfVocabTree(v.vocab_size), max_new_tokens=6, draft_length=4
    )
    decoder.advance()
    decoder.deliver()  # the first token: no forward yet
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.advance()
    assert v.history_token_ids == [5, 6, 7, 8] and v.pending_len == 0
    decoder.settle()
    assert v.history_token_ids == [5, 6, 7, 8, decoder.delivered_ids[0]]


# ------------------------------------------------------------ sampling over trees
VOCAB = SMALL_VOCAB
SAMPLED = SamplingConfig(temperature=1.0)


def _broken_tree_accept(rows, block, sampling, generator):
    """Wrong on purpose: a rejected child is not removed from p before trying the next."""
    path, node = [], 0
    while True:
        p = sampling.probs(rows[node])
        for child in block.children(node):
            if float(torch.rand((), generator=generator)) < float(p[block.tokens[child]]):
                path.append(child)
                node = child
                break
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))


def _first_two_tokens_over_a_tree(accept, samples=20000):
    """Chi-square p-value of the first two tokens emitted after x when a fixed 2x2 tree
    (the likeliest tokens first, so both branches are taken) is verified, against the
    verifier's exact joint distribution."""
    target = small_vocab_model(1)
    config = SinkWindowConfig(sink=2, window=6)
    prompt, x = [1, 5, 2, 7, 3, 0, 6, 4], 3
    p1 = sampling_probs(reference.dense_logits(target, prompt + [x], config)[-1], temperature=1.0)
    a1, a2 = torch.argsort(p1, descending=True)[:2].tolist()
    p2 = {
        a: sampling_probs(
            reference.dense_logits(target, prompt + [x, a], config)[-1], temperature=1.0
        )
        for a in range(VOCAB)
    }
    b1, b2 = torch.argsort(p2[a1], descending=True)[:2].tolist()
    c1, c2 = torch.argsort(p2[a2], descending=True)[:2].tolist()
    tree = DraftTree([a1, a2, b1, b2, c1, c2], [-1, -1, 0, 0, 1, 1])
    v = Verifier(target, config)
    v.append(prompt)
    block = tree.rooted(x)
    rows = v.forward_tree(block)
    gen = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    for _ in range(samples):
        path, nxt = accept(rows, block, SAMPLED, gen)
        emitted = ([block.tokens[i] for i in path] + [nxt])[:2]
        if len(emitted) < 2:  # the next step's first token, sampled plainly
            emitted.append(int(torch.multinomial(p2[emitted[0]], 1, generator=gen)))
        counts[tuple(emitted)] += 1
    expected, observed = [], []
    for a in range(VOCAB):
        for b in range(VOCAB):
            expected.append(float(p1[a] * p2[a][b]) * samples)
            observed.append(counts[a, b])
    keep = [i for i, e in enumerate(expected) if e >= 5]
    exp = torch.tensor([expected[i] for i in keep], dtype=torch.float64)
    obs = torch.tensor([observed[i] for i in keep], dtype=torch.float64)
    exp = exp * obs.sum() / exp.sum()
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.slow
def test_rejection_sampling_over_trees_preserves_the_distribution():
    assert _first_two_tokens_over_a_tree(accept_sampled_tree) > 1e-3


@pytest.mark.slow
def test_the_tree_distribution_check_catches_a_wrong_elimination():
    assert _first_two_tokens_over_a_tree(_broken_tree_accept) < 1e-6


def test_greedy_tree_acceptance_follows_the_argmax():
    block = DraftTree([9, 1, 2, 3, 4], [-1, 0, 0, 2, 2])
    rows = torch.full((5, 8), -1.0)
    rows[0, 2] = rows[2, 4] = rows[4, 6] = 1.0  # root -> 2 (node 2) -> 4 (node 4) -> 6
    assert accept_greedy_tree(rows, block) == ([2, 4], 6)


def test_a_chain_as_a_1_wide_tree_samples_exactly_like_the_chain(tiny_model):
    """Same seed, same draws: rejection sampling over a 1-wide tree carrying the draft
    model's proposal distributions emits the chain decoder's stream, past eviction."""
    model = tiny_model.model
    config = SinkWindowConfig(sink=2, window=8)
    prompt = list(range(100, 130))
    sampling = SamplingConfig(temperature=0.7, seed=5)
    streams = []
    for wrap in (False, True):
        proposer = DraftModelProposer(model, config)
        v = Verifier(model, config)
        decoder = speculative_decode(
            v,
            v.append(prompt),
            ChainTree(proposer) if wrap else proposer,
            max_new_tokens=30,
            draft_length=3,
            sampling=sampling,
        )
        out = [t for t in decoder if not isinstance(t, SpeculativeStep)]
        assert v.history_token_ids == prompt + out
        streams.append(out)
    assert streams[0] == streams[1]


def test_sampled_tree_decoding_commits_what_it_delivers():
    """Sampling with a branching tree proposer past eviction (an 8-token vocabulary, so
    the suffix index always matches): the committed cache equals a fresh replay of the
    delivered stream."""
    model = small_vocab_model(1)
    config = SinkWindowConfig(sink=2, window=8, positions="rolling")
    prompt = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7] * 3
    v = Verifier(model, config)
    decoder = speculative_decode(
        v,
        v.append(prompt),
        SuffixTreeProposer(min_probability=0.01),
        max_new_tokens=40,
        draft_length=8,
        sampling=SamplingConfig(temperature=1.0, seed=3),
    )
    out = list(decoder)
    tokens = [t for t in out if not isinstance(t, SpeculativeStep)]
    steps = [s for s in out if isinstance(s, SpeculativeStep)]
    assert v.history_token_ids == prompt + tokens
    assert all(s.tree for s in steps) and sum(s.accepted for s in steps) > 0
    fresh = Verifier(model, config)
    fresh.append(v.history_token_ids)
    assert fresh.cached_token_ids == v.cached_token_ids


def test_tree_specs_pass_the_cli_and_long_run_checks():
    from kakeya_lab.cli_args import UserError, check_proposer
    from kakeya_lab.proposers import check_proposer_spec

    specs = ("ngram-tree", "ngram-tree:3,2", "suffix-tree", "suffix-tree:6", "tree:ngram")
    for spec in specs:
        check_proposer_spec(spec)
        check_proposer(spec)
    check_proposer_spec("drafter-tree:mine")  # the CLI also looks the name up (test_named_drafters)
    bad_specs = ("tree:suffix-tree", "draft-tree:x", "tree:", "ngram-tree:x", "suffix-tree:x")
    for bad in (*bad_specs, "drafter-tree:", "tree:drafter-tree:mine"):
        with pytest.raises(ValueError):
            check_proposer_spec(bad)
        with pytest.raises(UserError):
            check_proposer(bad)


def test_mlx_bad_trees_and_paths_lose_nothing(tiny_on):
    """On MLX too: a refused tree or path changes nothing, and a tree forward that fails
    midway leaves no block behind (the next forward is plain)."""
    v = Verifier(tiny_on("qwen3", "mlx"), SinkWindowConfig(sink=2, window=6))
    v.append([1, 2, 3])
    with pytest.raises(ValueError):
        v.forward_tree(DraftTree([4, v.vocab_size], [-1, 0]))
    assert v.history_token_ids == [1, 2, 3] and v.pending_len == 0 and v.cache.pending_len == 0
    v.forward_tree(DraftTree([4, 5, 6], [-1, -1, 1]))
    with pytest.raises(ValueError, match="not a root-to-node path"):
        v.commit_path([0, 2])
    assert v.cache.pending_len == 3
    v.commit_path([1, 2])
    assert v.history_token_ids == [1, 2, 3, 5, 6] and v.cached_positions() == [0, 1, 2, 3, 4]
    v.forward_block([7])
    v.commit(1)
    assert v.history_token_ids == [1, 2, 3, 5, 6, 7]


@pytest.mark.slow
def test_tree_sessions_match_plain_across_turns(default_model):
    """Through the session runtime, over several chat turns past the window, with the
    suffix tree sharing replies across the turns' index."""
    from kakeya_lab.chat import ChatTemplate
    from kakeya_lab.proposers.suffix import SharedReplies
    from kakeya_lab.session import SessionStore, Token

    model, tok = default_model.model, default_model.tokenizer
    config = SinkWindowConfig(sink=4, window=48)
    outputs = {}
    shared = SharedReplies()
    for label, proposer in (
        ("plain", None),
        ("suffix-tree", SuffixTreeProposer(shared=shared)),
        ("ngram-tree", NgramTreeProposer()),
    ):
        store = SessionStore(model, config)
        sid = store.create()
        chat = ChatTemplate(tok)
        toks = []
        for user in ["Hi there!", "Name three colours.", "And three more?"]:
            store.append(sid, chat.user(user))
            events = list(store.generate(sid, 16, proposer=proposer, draft_length=8))
            reply = [e.id for e in events if isinstance(e, Token)]
            chat.generated(reply, eos_token_ids=store.eos_token_ids)
            toks += reply
            if proposer is not None:
                steps = [e for e in events if isinstance(e, SpeculativeStep)]
                # a step with no room for a draft (the reply's last token) is plain
                assert any(s.tree for s in steps)
                assert all(s.tree or s.draft_length == 0 for s in steps)
        outputs[label] = toks
        assert store.info(sid).history_len > config.budget
    assert outputs["suffix-tree"] == outputs["plain"]
    assert outputs["ngram-tree"] == outputs["plain"]
    assert shared.replies == 3
