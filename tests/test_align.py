"""Proposer alignment on the default real model: rollouts, training, checkpoints, lossless use.

One small capture (train and dev chit-chat conversations) and one short training run per
drafter kind are shared by the tests of this module.
"""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

from kakeya_lab.align.evaluate import drafter_factory, evaluate_by_domain
from kakeya_lab.align.pipeline import best_drafter, drafter_shapes, per_domain, train_config_for
from kakeya_lab.align.rollouts import (
    CaptureOptions,
    RolloutError,
    capture_rollouts,
    draft_vocabulary,
    load_rollouts,
)
from kakeya_lab.align.train import RolloutData, TrainConfig, evaluate_offline, train_drafter
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.bench.speculative import greedy_streams_identical, run_speculative
from kakeya_lab.bench.speculative_settings import SpeculativeSettings
from kakeya_lab.data import domain_conversations
from kakeya_lab.proposers.drafters.checkpoint import CheckpointError, load_drafter, save_drafter
from kakeya_lab.proposers.drafters.network import DrafterConfig, build_drafter, drafter_config_for
from kakeya_lab.proposers.drafters.proposer import DrafterProposer, DrafterTreeProposer
from kakeya_lab.reference import oracle_logits
from kakeya_lab.session import model_eos_ids
from kakeya_lab.verifier import HiddenTrace, Verifier

CAPTURE_CACHE = SinkWindowConfig(sink=4, window=124)
OPTIONS = CaptureOptions(turns_per_conversation=2, max_new_tokens=24, shard_size=4)
SHAPES = drafter_shapes(
    context_len=8, block_size=4, block_width=256, lora_base="early-exit:8", lora_rank=8
)
STEPS = {"feature": 100, "block": 150, "lora": 2}  # LoRA: mechanics only (no quality test)


@pytest.fixture(scope="module")
def rollouts(default_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rollouts")
    for split, limit in (("train", 10), ("dev", 3)):
        capture_rollouts(
            default_model,
            domain_conversations("chitchat", split, limit=limit),
            root / split,
            config=CAPTURE_CACHE,
            split=split,
            options=OPTIONS,
            progress=False,
        )
    train, dev = load_rollouts(root / "train"), load_rollouts(root / "dev")
    vocab = draft_vocabulary(train, 2048, always=model_eos_ids(default_model.model))
    return {"root": root, "train": train, "dev": dev, "vocab": vocab}


def _fresh(kind, default_model, rollouts):
    torch.manual_seed(0)
    return build_drafter(
        drafter_config_for(kind, default_model, rollouts["vocab"], **SHAPES[kind]),
        default_model.model,
    )


def _data(kind, rollouts, split):
    s = SHAPES[kind]
    return RolloutData(rollouts[split], context_len=s["context_len"], block_size=s["block_size"])


@pytest.fixture(scope="module")
def trained(default_model, rollouts, tmp_path_factory):
    """kind -> (untrained offline eval, trained drafter, its history, its run folder)."""
    out = {}
    for kind in ("feature", "block", "lora"):
        drafter = _fresh(kind, default_model, rollouts)
        dev = _data(kind, rollouts, "dev")
        cfg = TrainConfig(
            steps=STEPS[kind],
            batch_size=16 if kind != "lora" else 4,
            eval_every=STEPS[kind],
            checkpoint_every=STEPS[kind],
            # LoRA's draft is 8 of the verifier's layers and no quality test reads its
            # evaluation: a few windows show the mechanics
            eval_windows=128 if kind != "lora" else 16,
            lr=2e-3 if kind != "lora" else 5e-4,
        )
        before = evaluate_offline(
            drafter, dev.fixed(cfg.eval_windows), drafter.config.block_size, cfg.loss
        )
        folder = tmp_path_factory.mktemp(f"train-{kind}")
        history = train_drafter(
            drafter, _data(kind, rollouts, "train"), cfg, folder, eval_data=dev, progress=False
        )
        out[kind] = (before, drafter, history, folder)
    return out


# ---------------------------------------------------------------- rollouts


@pytest.mark.slow  # captures real rollouts and trains drafters (about two minutes together)
def test_rollouts_hold_the_verifiers_own_greedy_tokens(rollouts):
    row = rollouts["train"][0]
    gen = row["generated"]
    assert gen.any() and not gen.all()
    # the verifier's top-1 at i is the token it generated at i + 1
    assert (row["topk_ids"][:-1, 0][gen[1:]] == row["token_ids"][1:][gen[1:]]).all()
    assert row["hidden"].shape == (len(row["token_ids"]), 576)
    assert (row["positions"] == range(len(row["token_ids"]))).all()
    lengths = [len(r["token_ids"]) for r in rollouts["train"]]
    assert max(lengths) > CAPTURE_CACHE.sink + CAPTURE_CACHE.window  # captured across eviction


def test_rollout_capture_resumes_without_duplicating_or_losing_rows(tiny_model, tmp_path):
    convs = domain_conversations("chitchat", "train", limit=5)
    opts = CaptureOptions(turns_per_conversation=1, max_new_tokens=4, shard_size=2)
    kw = dict(config=SinkWindowConfig(2, 6), split="train", options=opts, progress=False)
    capture_rollouts(tiny_model, convs, tmp_path / "a", **kw)
    whole = load_rollouts(tmp_path / "a")

    class Interrupted(Exception):
        pass

    def stop_after_first(index):
        (tmp_path / "b" / "shard-00001").mkdir()  # a half-written shard left behind
        raise Interrupted

    with pytest.raises(Interrupted):
        capture_rollouts(tiny_model, convs, tmp_path / "b", on_shard=stop_after_first, **kw)
    partial = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [s["rows"] for s in partial["shards"]] == [2]
    capture_rollouts(tiny_model, convs, tmp_path / "b", **kw)
    resumed = load_rollouts(tmp_path / "b")
    assert list(resumed["conversation_id"]) == [c.id for c in convs]
    assert list(resumed["conversation_id"]) == list(whole["conversation_id"])
    for a, b in zip(whole, resumed):
        assert (a["token_ids"] == b["token_ids"]).all() and (a["hidden"] == b["hidden"]).all()
    with pytest.raises(RolloutError, match="other options"):
        capture_rollouts(
            tiny_model,
            convs,
            tmp_path / "b",
            config=SinkWindowConfig(2, 6),
            split="train",
            options=CaptureOptions(top_k=5),
            progress=False,
        )


def test_teacher_forced_capture_appends_the_conversations_own_replies(
    tiny_model, tmp_path, record_tolerance
):
    """The whole conversation is one chunked append past eviction: its targets are the
    dense masked oracle's logits, and the record says how fast and how big it was."""
    conv = domain_conversations("chitchat", "train", limit=1)
    opts = CaptureOptions(
        turns_per_conversation=3, shard_size=1, replies="dataset", max_repetition=None, top_k=5
    )
    config = SinkWindowConfig(2, 6)
    manifest = capture_rollouts(
        tiny_model, conv, tmp_path, config=config, split="train", options=opts, progress=False
    )
    row = load_rollouts(tmp_path)[0]
    reply_text = tiny_model.tokenizer.decode(row["token_ids"][row["generated"]])
    assert conv[0].turns[1] in reply_text and conv[0].turns[3] in reply_text
    assert conv[0].turns[0] not in reply_text
    tokens = row["token_ids"].tolist()
    assert len(tokens) > 4 * config.budget  # far past eviction
    want = oracle_logits(tiny_model.model, tokens, config)
    got = torch.from_numpy(row["topk_logits"])
    diff = float((got - want.gather(1, torch.from_numpy(row["topk_ids"]).long())).abs().max())
    record_tolerance("teacher-forced capture vs oracle (tiny, global)", diff)
    assert diff < 1e-4
    assert (torch.from_numpy(row["topk_ids"][:, 0]) == want.argmax(-1)).all()
    stats = manifest["stats"]
    assert stats["tokens"] == len(tokens) and stats["conversations"] == 1
    assert stats["seconds"] > 0 and stats["tokens_per_s"] > 0
    assert stats["bytes"] > row["hidden"].size * 2  # the float16 hidden states alone
    with pytest.raises(ValueError, match="replies"):
        CaptureOptions(replies="invented")


def test_hidden_trace_drops_rows_of_a_rolled_back_block(tiny_model):
    v = Verifier(tiny_model.model, SinkWindowConfig(2, 6))
    trace = v.trace_hidden(16)
    v.append([5, 6, 7])
    v.forward_block([8, 9])
    v.rollback()
    v.forward_block([10])
    v.commit(1)
    assert trace.features([3], [10]) is not None
    assert trace.features([3], [8]) is None and trace.features([4], [9]) is None
    assert trace.held_suffix([5, 6, 7, 10], 8) == 4
    assert HiddenTrace(2).held_suffix([1], 4) == 0


# ---------------------------------------------------------------- training


def _random_feature_drafter(tiny_model):
    """A two-layer feature drafter with random weights, sharpened so its choices are
    clear (mechanics only: its drafts mean nothing)."""
    torch.manual_seed(0)
    config = DrafterConfig(
        kind="feature",
        hidden_size=tiny_model.model.config.hidden_size,
        vocab_size=tiny_model.model.config.vocab_size,
        verifier_sha256=None,
        draft_vocab=list(range(300, 812)),
        num_layers=2,
        num_heads=4,
        context_len=6,
    )
    drafter = build_drafter(config, tiny_model.model)
    with torch.no_grad():
        drafter.out.weight.mul_(40.0)
    return drafter


def _naive_draft(drafter, feats, toks, k):
    """Greedy drafting by a whole forward over the growing sequence at every step."""
    feats, toks, out = feats[None], torch.tensor([toks]), []
    with torch.no_grad():
        for _ in range(k):
            f = drafter(feats, toks)[:, -1:]
            out.append(int(drafter.draft_ids[drafter.logits(f[0, 0]).argmax()]))
            feats, toks = torch.cat([feats, f], 1), torch.cat([toks, torch.tensor([[out[-1]]])], 1)
    return out


def test_feature_drafter_extends_its_cached_keys_as_a_whole_forward_would(
    tiny_model, record_tolerance
):
    """Drafting runs the context through the layers once and then one row per draft and
    path (the cached keys and values gathered per path); every predicted feature equals
    the whole-sequence forward's, chains equal the naive loop, and a tree node is one of
    its parent path's likeliest tokens."""
    drafter = _random_feature_drafter(tiny_model)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(6, drafter.config.hidden_size, generator=g)
    toks = torch.randint(0, 2000, (6,), generator=g).tolist()
    more_feats = torch.randn(3, 4, drafter.config.hidden_size, generator=g)  # 3 paths, 4 steps
    more_toks = torch.randint(0, 2000, (3, 4), generator=g)
    worst = 0.0
    with torch.no_grad():
        pred, past = drafter._prefill(feats, toks)
        whole = drafter(feats[None], torch.tensor([toks]))
        worst = float((pred - whole[:, -1]).abs().max())
        past = [(k[[0, 0, 0]], v[[0, 0, 0]]) for k, v in past]  # one context, three paths
        for i in range(4):
            pred, past = drafter._extend(more_feats[:, i : i + 1], more_toks[:, i : i + 1], past)
            whole = drafter(
                torch.cat([feats[None].expand(3, -1, -1), more_feats[:, : i + 1]], 1),
                torch.cat([torch.tensor([toks]).expand(3, -1), more_toks[:, : i + 1]], 1),
            )
            worst = max(worst, float((pred - whole[:, -1]).abs().max()))
    record_tolerance("feature drafter cached extend vs whole forward (random)", worst)
    assert worst < 1e-4
    assert drafter.draft(feats, toks, 5)[0] == _naive_draft(drafter, feats, toks, 5)
    tree = drafter.draft_tree(feats, toks, 9, branch=3)
    assert len(tree) == 9 and tree.depth >= 2
    for node in range(len(tree)):
        path = tree.path(node)
        prefix = [tree.tokens[i] for i in path[:-1]]
        f, t = feats[None], torch.tensor([toks])
        with torch.no_grad():  # the path's own features, step by step, by whole forwards
            for token in prefix:
                last = drafter(f, t)[:, -1:]
                f, t = torch.cat([f, last], 1), torch.cat([t, torch.tensor([[token]])], 1)
            top = torch.topk(drafter.logits(drafter(f, t)[0, -1]), 3).indices
        assert tree.tokens[node] in drafter.draft_ids[top].tolist()


@pytest.mark.slow  # captures real rollouts and trains drafters (about two minutes together)
@pytest.mark.parametrize("kind,margin", [("feature", 0.15), ("block", 0.08)])
def test_training_increases_held_out_acceptance(trained, kind, margin):
    """Greedy offline acceptance of the first draft token on held-out (dev) conversations:
    the trained drafter beats its untrained initialisation by ``margin`` (seeded run)."""
    before, _, history, _ = trained[kind]
    after = history.dropna(subset=["accept_at_0"]).iloc[-1]
    print(
        f"{kind}: held-out greedy acceptance of draft 1 {before['accept_at_0']:.3f} -> "
        f"{after['accept_at_0']:.3f}, offline tau {before['offline_tau']:.2f} -> {after['offline_tau']:.2f}"
    )
    assert after["accept_at_0"] >= before["accept_at_0"] + margin, (before, dict(after))
    assert after["offline_tau"] > before["offline_tau"]
    assert (
        history["train_total"].dropna().iloc[-20:].mean()
        < history["train_total"].dropna().iloc[:20].mean()
    )


def test_the_evaluation_times_plain_decoding_on_each_kernel_and_takes_the_fastest(default_model):
    from kakeya_lab.linear import linear_kernel_of
    from kakeya_lab.linear_auto import full_precision_kernels
    from kakeya_lab.proposers import NgramProposer

    own = linear_kernel_of(default_model.model)
    other = next(k for k in full_precision_kernels() if k != own)
    summary, _ = evaluate_by_domain(
        default_model,
        {"ngram": NgramProposer},
        [3],
        config=SinkWindowConfig(sink=4, window=28),
        domains=["code"],
        splits=["dev"],
        conversations=1,
        turns=1,
        max_new_tokens=8,
        plain_kernels=(other,),
        progress=False,
    )
    rows = summary.set_index("arm")
    plain = rows[rows.index.str.startswith("plain")]
    assert sorted(plain.index) in (["plain", f"plain[{other}]"], ["plain", f"plain[{own}]"])
    assert plain.loc["plain", "tokens_per_s"] == plain["tokens_per_s"].max()
    winner = other if f"plain[{own}]" in plain.index else own
    assert set(summary["plain_kernel"]) == {winner} and summary["lossless"].all()
    assert rows.loc["ngram@3", "generated_tokens"] == rows.loc["plain", "generated_tokens"]


@pytest.mark.slow  # captures real rollouts and trains drafters (about two minutes together)
def test_greedy_speculative_decoding_with_every_trained_drafter_is_lossless(default_model, trained):
    cache = SinkWindowConfig(sink=4, window=28)  # small: drafting crosses eviction
    proposers = {kind: drafter_factory(trained[kind][1], cache, label=kind) for kind in trained}
    proposers["feature-tree"] = lambda: DrafterTreeProposer(trained["feature"][1], branch=3)
    run = run_speculative(
        default_model,
        proposers,
        domain_conversations("chitchat", "dev", limit=1),
        SpeculativeSettings.for_cache(cache, draft_lengths=(3,), turns=2, max_new_tokens=16),
        progress=False,
    )
    assert greedy_streams_identical(run.turns)
    assert run.turns["history_len"].max() > 32
    s = run.summary.set_index("arm")
    for kind in trained:
        assert s.loc[f"{kind}@3", "generated_tokens"] == s.loc["plain", "generated_tokens"]
    assert run.steps.groupby("arm")["proposed"].sum().min() > 0
    assert s.loc["feature@3", "acceptance_rate"] > 0  # not lossless by proposing nothing
    assert s.loc["feature-tree@3", "acceptance_rate"] > 0


@pytest.mark.slow  # captures real rollouts and trains drafters (about two minutes together)
def test_feature_drafter_trees_rank_paths_by_the_drafters_confidence(default_model, trained):
    drafter = trained["feature"][1]
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(8, drafter.config.hidden_size, generator=g)
    toks = torch.randint(0, 2000, (8,), generator=g).tolist()
    chain, _ = drafter.draft(feats, toks, 4)
    tree = drafter.draft_tree(feats, toks, 10, branch=3)
    assert len(tree) == 10 and tree.tokens[0] == chain[0]  # the likeliest node of all
    with torch.no_grad():
        first = drafter.logits(drafter(feats[None], torch.tensor([toks]))[0, -1])
    ranked = drafter.draft_ids[torch.topk(first, 3).indices].tolist()
    roots = [tree.tokens[i] for i in tree.children(-1)]
    assert roots == ranked[: len(roots)]  # the first draft's likeliest tokens, in order
    assert tree.depth >= 2  # ten nodes, at most three roots
    assert drafter.draft_tree(feats, toks, 1, branch=3).tokens == (chain[0],)
    with pytest.raises(ValueError, match="feature drafter"):
        DrafterTreeProposer(trained["block"][1])


# ---------------------------------------------------------------- checkpoints


@pytest.mark.slow  # captures real rollouts and trains drafters (about two minutes together)
@pytest.mark.parametrize("kind", ["feature", "block", "lora"])
def test_checkpoint_round_trip_gives_the_same_drafts(
    default_model, rollouts, trained, kind, tmp_path
):
    _, drafter, _, folder = trained[kind]
    loaded = load_drafter(folder / "drafter", default_model)
    batch = _data(kind, rollouts, "dev").fixed(8)
    with torch.no_grad():
        a = drafter.logits(drafter.predict(batch["features"], batch["tokens"], 4)[0])
        b = loaded.logits(loaded.predict(batch["features"], batch["tokens"], 4)[0])
    assert torch.equal(a.argmax(-1), b.argmax(-1)) and torch.allclose(a, b)
    if kind != "lora":
        p, q = DrafterProposer(drafter), DrafterProposer(loaded)
        v = Verifier(default_model.model, CAPTURE_CACHE)
        p.bind(v), q.bind(v)
        ctx = list(rollouts["dev"][0]["token_ids"][:40].tolist())
        v.append(ctx[:-1])
        assert p.propose(ctx, 4).tokens == q.propose(ctx, 4).tokens
        assert len(p.propose(ctx, 4).tokens) == 4


@pytest.mark.slow  # captures real rollouts and trains drafters (about two minutes together)
def test_resume_mid_training_matches_an_uninterrupted_run(default_model, rollouts, tmp_path):
    cfg = TrainConfig(
        steps=12, batch_size=8, warmup_steps=3, checkpoint_every=4, eval_every=6, eval_windows=16
    )
    data, dev = _data("feature", rollouts, "train"), _data("feature", rollouts, "dev")
    straight = _fresh("feature", default_model, rollouts)
    h1 = train_drafter(straight, data, cfg, tmp_path / "a", eval_data=dev, progress=False)
    resumed = _fresh("feature", default_model, rollouts)
    train_drafter(resumed, data, cfg, tmp_path / "b", eval_data=dev, stop_after=5, progress=False)
    again = _fresh("feature", default_model, rollouts)  # a new process would start from init
    h2 = train_drafter(again, data, cfg, tmp_path / "b", eval_data=dev, progress=False)
    for (n, p), (_, q) in zip(straight.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    pd.testing.assert_frame_equal(h1, h2)
    with pytest.raises(CheckpointError, match="other settings"):
        train_drafter(
            _fresh("feature", default_model, rollouts),
            data,
            TrainConfig(steps=12, batch_size=4),
            tmp_path / "b",
            progress=False,
        )


@pytest.mark.slow  # captures real rollouts and trains drafters (about two minutes together)
def test_mismatched_or_corrupted_checkpoints_are_clear_errors(
    default_model, tiny_model, trained, tmp_path
):
    src = trained["feature"][3] / "drafter"
    with pytest.raises(CheckpointError, match="vocabulary .* width"):
        load_drafter(src, tiny_model)
    other = tmp_path / "other-verifier"
    shutil.copytree(src, other)
    cfg = json.loads((other / "drafter.json").read_text())
    (other / "drafter.json").write_text(json.dumps({**cfg, "verifier_sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match="trained against verifier weights"):
        load_drafter(other, default_model)
    other_vocab = tmp_path / "other-vocab"
    shutil.copytree(src, other_vocab)
    (other_vocab / "drafter.json").write_text(json.dumps({**cfg, "vocab_size": 60000}))
    with pytest.raises(CheckpointError, match="vocabulary 60000"):
        load_drafter(other_vocab, default_model)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    data = (broken / "drafter.safetensors").read_bytes()
    (broken / "drafter.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted"):
        load_drafter(broken, default_model)
    (broken / "drafter.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupted"):
        load_drafter(broken, default_model)
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(tmp_path / "nowhere", default_model)
    block = trained["block"][1]
    wrong_shape = tmp_path / "wrong-shape"
    save_drafter(block, wrong_shape)
    (wrong_shape / "drafter.json").write_text(json.dumps({**block.config.to_dict(), "width": 128}))
    with pytest.raises(CheckpointError, match="does not fit"):
        load_drafter(wrong_shape, default_model)


# ---------------------------------------------------------------- pipeline settings


def test_pipeline_settings_per_domain_and_per_kind():
    assert per_domain(3, ["chitchat", "code"]) == {"chitchat": 3, "code": 3}
    assert per_domain({"chitchat": 1, "code": 2, "prose": 5}, ["code"]) == {"code": 2}
    with pytest.raises(ValueError, match="prose"):
        per_domain({"chitchat": 1}, ["chitchat", "prose"])
    lora, feature = (
        train_config_for("lora", 8, lr=2e-3),
        train_config_for("feature", 60, batch_size=16),
    )
    assert (lora.batch_size, lora.lr, lora.steps) == (4, 5e-4, 8)
    assert (
        feature.batch_size,
        feature.eval_every,
        feature.checkpoint_every,
        feature.warmup_steps,
    ) == (16, 12, 30, 13)
    assert SHAPES["lora"]["context_len"] == 3 * SHAPES["feature"]["context_len"]


def test_best_drafter_is_the_highest_held_out_tau_of_the_trained_kinds():
    summary = pd.DataFrame(
        [
            {"domain": "chitchat", "split": "dev", "proposer": "feature", "tau": 1.2},
            {"domain": "chitchat", "split": "dev", "proposer": "block", "tau": 1.4},
            {"domain": "chitchat", "split": "dev", "proposer": "ngram", "tau": 1.9},  # not trained
            {
                "domain": "chitchat",
                "split": "train",
                "proposer": "feature",
                "tau": 2.5,
            },  # not held out
            {"domain": "code", "split": "dev", "proposer": "feature", "tau": 3.0},
        ]
    )
    assert best_drafter(summary, "chitchat", ["feature", "block"]) == "block"
    assert best_drafter(summary, "code", ["feature", "block"]) == "feature"
    with pytest.raises(ValueError, match="prose"):
        best_drafter(summary, "prose", ["feature"])
