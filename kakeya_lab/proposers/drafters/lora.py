"""LoRA distillation of a draft model toward the verifier (the third drafter kind).

The draft model is a copy of the verifier's first ``L`` layers with its final norm and
lm_head (``base="early-exit:L"``); LoRA adapters (``peft``) on every attention and MLP
projection are the only trained weights. It trains on the same rollout windows and losses
as the feature drafters — its final hidden state is the predicted feature, its lm_head the
verifier's — and drafts as a :class:`~kakeya_lab.proposers.DraftModelProposer` with its
own sink-window cache (adapters merged into a copy).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from kakeya_lab.proposers.early_exit import early_exit_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_base(base: str, total_layers: int) -> int:
    kind, _, arg = base.partition(":")
    if kind != "early-exit" or not arg.isdigit() or not 1 <= int(arg) < total_layers:
        raise ValueError(
            f"lora base must be 'early-exit:L' with 1 <= L < {total_layers}, got {base!r}"
        )
    return int(arg)


class LoraDrafter(nn.Module):
    """A LoRA-adapted early-exit copy of the verifier, trained with the drafter losses."""

    # buffers (register_buffer), typed for the checker
    draft_ids: torch.Tensor
    draft_index: torch.Tensor

    def __init__(self, config, verifier_model):
        super().__init__()
        from peft import LoraConfig, get_peft_model

        self.config = config
        layers = parse_base(config.base, verifier_model.config.num_hidden_layers)
        draft = copy.deepcopy(early_exit_model(verifier_model, layers))  # own weights, frozen
        draft.set_attn_implementation("sdpa")
        draft.requires_grad_(False)
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0,
            target_modules=TARGETS,
            bias="none",
        )
        with warnings.catch_warnings():
            # peft asks transformers v5 a deprecated question; nothing for our callers to act on
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            self.model = get_peft_model(draft, lora)
        ids = torch.arange(config.vocab_size)
        self.register_buffer("draft_ids", ids, persistent=False)
        self.register_buffer("draft_index", ids.clone(), persistent=False)

    def predict(self, window_features, window_tokens, draft_length):
        """Final hidden states of the draft over the window's tokens; the one at offset
        ``o`` predicts the token at ``o + 1`` (offsets ``0 .. n+k-1``, ``k`` =
        ``draft_length``, which the window's size already fixes)."""
        out = self.model(
            input_ids=window_tokens[:, :-1], output_hidden_states=True, use_cache=False
        )
        hidden = out.hidden_states[-1]
        return hidden, torch.arange(hidden.shape[1])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(features)

    def draft_model(self):
        """A plain causal LM with the adapters merged in (a copy; this drafter is unchanged)."""
        merged = copy.deepcopy(self.model).merge_and_unload()
        merged.eval()
        return merged
