"""``FIRST+SECOND`` proposers (``kakeya_lab.proposers.FallbackProposer``): the second drafts
when the first offers too little, each keeps its own state in step with the session, and
greedy speculative decoding stays equal to plain decoding past eviction. Mechanics on the
tiny random model as its own draft model (its drafts always agree, so a draft model that
fell out of step with the session would show as a rejected draft)."""

from __future__ import annotations

import pytest

from kakeya_lab import SinkWindowConfig, Verifier
from kakeya_lab.proposers import DraftModelProposer, FallbackProposer, make_proposer
from kakeya_lab.proposers.registry import check_proposer_spec
from kakeya_lab.proposers.suffix import SuffixProposer
from kakeya_lab.speculative import plain_decode, speculative_decode


def test_suffix_then_draft_model_is_lossless_past_eviction(tiny_model, text_ids):
    model = tiny_model.model
    config = SinkWindowConfig(sink=4, window=28)
    prompt = text_ids[:120]  # the text repeats: the suffix index has matches to draft from
    v = Verifier(model, config)
    want = list(plain_decode(v, v.append(prompt), max_new_tokens=60))
    proposer = make_proposer(
        f"suffix+draft:{tiny_model.description.name}",
        model,
        config,
        tiny_model.tokenizer,
        draft_model=tiny_model,
    )
    assert isinstance(proposer, FallbackProposer)
    assert isinstance(proposer.first, SuffixProposer)
    assert isinstance(proposer.second, DraftModelProposer)
    v = Verifier(model, config)
    decoder = speculative_decode(v, v.append(prompt), proposer, max_new_tokens=60, draft_length=4)
    got = [t for t in decoder if isinstance(t, int)]
    assert got == want
    assert v.cache_len == config.budget  # evicted throughout
    by_suffix, by_draft = proposer.drafts
    assert by_suffix > 0 and by_draft > 0, proposer.drafts  # both drafted
    assert len(proposer.chosen) == len(decoder.steps)
    # the draft model is the verifier itself: each of its drafts is kept whole, which holds
    # only if it caught up on the tokens the suffix steps added before drafting
    for chosen, step in zip(proposer.chosen, decoder.steps, strict=True):
        if chosen == 1:
            assert step.accepted == step.proposed > 0, step
    history = v.history_token_ids
    draft_history = proposer.second.verifier.history_token_ids
    assert history[: len(draft_history)] == draft_history
    assert proposer.describe()["drafts"] == [by_suffix, by_draft]


def test_bad_combinations_are_clear_errors(tiny_model):
    config = SinkWindowConfig(sink=4, window=28)
    with pytest.raises(ValueError, match="two chain proposers"):
        make_proposer("none+ngram", tiny_model.model, config)
    with pytest.raises(ValueError, match="chain proposers"):
        make_proposer("suffix-tree+ngram", tiny_model.model, config)
    with pytest.raises(ValueError, match="chain proposers"):
        check_proposer_spec("ngram+drafter-tree:x")
    with pytest.raises(ValueError, match="draft:MODEL"):
        check_proposer_spec("suffix+draft:")
    check_proposer_spec("suffix+draft:qwen2.5-coder-0.5b-instruct")
    with pytest.raises(ValueError, match="min_tokens"):
        FallbackProposer(SuffixProposer(), SuffixProposer(), min_tokens=0)
