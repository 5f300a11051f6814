"""The streaming detokenizer (HTTP and gRPC streams, chat panel, chat command): the deltas it returns token by token are those
of re-decoding the whole reply every token (the default model's real tokenizer; text with
multi-byte characters split across tokens)."""

from __future__ import annotations

from kakeya_lab.session import StreamingDetokenizer, text_pieces

TEXT = (
    "Héllo wörld! 你好，世界 🌍🚀 naïve café — ‘quotes’\n\n  spaces   and\ttabs. Ünïcödé 😀😀 end"
)


def test_deltas_equal_re_decoding_the_whole_reply(tiny_model):
    tok = tiny_model.tokenizer
    eos = {tok.eos_token_id}

    def text_of(ids: list[int]) -> str:
        return tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)

    ids = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    expected, shown = [], ""
    for n in range(1, len(ids) + 1):
        text = text_of(ids[:n])
        if not text.endswith("\ufffd"):
            delta, shown = text[len(shown) :], text
            expected.append(delta)
    detok = StreamingDetokenizer(text_of)
    got = [detok.add(i) for i in ids]
    assert [d for d in got if d] == [d for d in expected if d]
    assert "".join(got) == text_of(ids) == TEXT
    assert any(not d for d in got[:-1])  # some token ended inside a UTF-8 sequence


def test_for_tokenizer_and_text_pieces(tiny_model):
    """The tokenizer-backed detokenizer skips the given ids; ``text_pieces`` joins to the
    whole decode, one piece per token."""
    tok = tiny_model.tokenizer
    ids = tok(TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    detok = StreamingDetokenizer.for_tokenizer(tok, skip_ids={tok.eos_token_id})
    assert "".join(detok.add(i) for i in ids) == TEXT
    pieces = text_pieces(detok.decode, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == TEXT
