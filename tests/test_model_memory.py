"""kakeya_lab.models.memory: a loaded model's weights in one block of huge pages."""

from __future__ import annotations

import pytest
import torch

from kakeya_lab.backends.torch_lean import LeanForward
from kakeya_lab.models import load_model, tiny_random_model
from kakeya_lab.models.memory import HUGE_PAGE, huge_page_tensor, place_weights


def _mapping_of(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding address ``ptr``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= ptr < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _thp_mode() -> str:
    text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    return text[text.index("[") + 1 : text.index("]")]


def test_huge_page_tensor_is_zeroed_aligned_and_advised():
    t = huge_page_tensor(3 * HUGE_PAGE // 4 + 5)
    assert t.dtype == torch.float32 and t.numel() == 3 * HUGE_PAGE // 4 + 5
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t.fill_(2.0)  # writable, the whole length
    assert t.sum().item() == 2.0 * t.numel()
    if _thp_mode() != "never":  # the kernel may use huge pages here: the mapping was advised
        assert _mapping_of(t.data_ptr())["THPeligible"] == "1"
    b = huge_page_tensor(10, torch.bfloat16)
    assert b.dtype == torch.bfloat16 and b.numel() == 10 and b.data_ptr() % HUGE_PAGE == 0
    with pytest.raises(ValueError, match="numel"):
        huge_page_tensor(-1)


def test_place_weights_keeps_parameters_values_and_ties():
    model = tiny_random_model("qwen3", seed=3).model  # tied embeddings
    params = dict(model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    flags = {name: p.requires_grad for name, p in params.items()}
    x = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        logits = model(x).logits
    placed = place_weights(model)
    assert placed == sum(p.nbytes for p in params.values())
    after = dict(model.named_parameters())
    assert all(after[name] is p for name, p in params.items())  # the same objects
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    storage = {p.untyped_storage().data_ptr() for p in after.values()}
    assert len(storage) == 1  # one block
    offset = next(iter(after.values())).storage_offset()
    for name, p in after.items():  # back to back, in named_parameters order
        assert p.storage_offset() == offset and p.is_contiguous(), name
        assert torch.equal(p, before[name]) and p.requires_grad == flags[name], name
        offset += p.numel()
    with torch.no_grad():
        assert torch.equal(model(x).logits, logits)
    # it still trains: a gradient step lands in the block
    model.train()
    loss = model(x, labels=x).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == storage


def test_loaded_model_lives_in_one_block_the_lean_step_stacks_in_place():
    model = load_model(progress=False).model
    params = list(model.parameters())
    block = params[0].untyped_storage().data_ptr()  # ints: a failure must not print 538 MB
    assert all(p.untyped_storage().data_ptr() == block for p in params)
    assert params[0].data_ptr() % HUGE_PAGE == 0
    if _thp_mode() != "never":
        assert _mapping_of(block)["THPeligible"] == "1"
    # Llama's q/k/v and gate/up are consecutive: the lean step's stacks are views, no copies
    lean = LeanForward(model)
    for layer in lean.layers:
        for stacked in (layer.qkv, layer.gate_up):
            assert stacked.weight.untyped_storage().data_ptr() == block
    assert all(p.untyped_storage().data_ptr() == block for p in model.parameters())
