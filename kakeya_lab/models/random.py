"""Tiny *randomly initialised* models with a real tokenizer, for fast mechanics tests.

Their description says ``random=True``; show it wherever a figure could be read as a
statement about quality.
"""

from __future__ import annotations

import hashlib

import torch

from kakeya_lab.models.errors import ModelStoreError
from kakeya_lab.models.load import (
    LoadedModel,
    as_torch_dtype,
    describe,
    enable_sink_window,
)
from kakeya_lab.models.registry import DEFAULT_MODEL
from kakeya_lab.models.resolve import resolve

__all__ = ["tiny_random_model"]


def _state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every state-dict entry, sorted by name."""
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tiny_random_model(
    architecture: str = "qwen3",
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    tokenizer_from: str = DEFAULT_MODEL,
    dtype: torch.dtype | str = torch.float32,
) -> LoadedModel:
    """A small *randomly initialised* causal LM with a real tokenizer, for mechanics tests.

    ``architecture`` is ``"qwen3"`` (Qwen3ForCausalLM: q/k norms, tied embeddings) or
    ``"llama"`` (LlamaForCausalLM). The tokenizer is that of ``tokenizer_from`` (resolved like
    :func:`load_model`, so a registry name is pulled if missing) and ``vocab_size`` defaults
    to ``len(tokenizer)``; a smaller one (the first ids only: the special tokens and the
    commonest pieces) makes each step cheaper for tests whose ids stay below it.
    Parameters are drawn from a private ``torch.Generator`` seeded with
    ``seed`` (linear/embedding weights N(0, 0.02), norm weights 1, biases 0) in float32 and
    then cast to ``dtype``, so the same arguments give the same weights and the same
    ``description.weight_sha256`` (hash of the state-dict bytes); the global RNG is untouched.
    ``description.random`` is True. Eval mode, sink-window attention enabled.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

    arch = architecture.lower()
    configs = {"qwen3": Qwen3Config, "llama": LlamaConfig}
    if arch not in configs:
        raise ModelStoreError(
            f"unsupported architecture {architecture!r}; use one of {sorted(configs)}"
        )
    if num_heads % num_kv_heads:
        raise ModelStoreError(
            f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    found = resolve(tokenizer_from, pull_if_missing=True, progress=True)
    folder, tok_name = found.folder, found.name
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    vocab = len(tokenizer) if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= len(tokenizer):
        raise ModelStoreError(f"vocab_size={vocab_size} is not in 1..{len(tokenizer)}")

    def token_id(attr: str) -> int | None:
        value = getattr(tokenizer, attr, None)
        return int(value) if isinstance(value, int) else None

    config = configs[arch](
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=32768,
        tie_word_embeddings=(arch == "qwen3"),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        pad_token_id=token_id("pad_token_id"),
    )
    with torch.random.fork_rng(devices=[]):  # transformers' own init must not move the global RNG
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            elif pname.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model = model.to(as_torch_dtype(dtype)).eval()
    enable_sink_window(model)
    name = f"tiny-random-{arch}"
    source = (
        f"random-init {arch} seed={seed} layers={num_layers} hidden={hidden_size} "
        f"heads={num_heads}/{num_kv_heads} head_dim={head_dim} vocab={vocab} "
        f"(tokenizer from {tok_name})"
    )
    description = describe(
        model, name=name, path="", sha=_state_dict_sha256(model), random=True, source=source
    )
    return LoadedModel(model, tokenizer, description)
