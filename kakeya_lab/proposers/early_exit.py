"""Self-speculation (``early-exit:LAYERS``): the verifier's first layers, with its final
norm and lm_head, draft for the whole model, sharing its weights."""

from __future__ import annotations

import copy
from typing import cast

import torch
from torch import nn
from transformers import PreTrainedModel

from kakeya_lab import inputs
from kakeya_lab.backends import registry
from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.proposers.draft_model import DraftModelProposer
from kakeya_lab.proposers.registry import ProposerRequest


def early_exit_model(model: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM made of ``model``'s embedding, first ``num_layers`` layers, final norm
    and lm_head — sharing the parameters (no copy)."""
    total = model.config.num_hidden_layers
    num_layers = inputs.count(
        num_layers,
        "num_layers",
        minimum=1,
        maximum=total - 1,
        hint=f"early exit keeps fewer than the model's {total} layers",
    )
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    with torch.device("meta"):
        draft = type(model)(cfg)
    base, sub = model.base_model, draft.base_model
    sub.embed_tokens = base.embed_tokens
    layers = cast(nn.ModuleList, base.layers)  # nn.Module attributes type as Tensor | Module
    sub.layers = nn.ModuleList(list(layers[:num_layers]))
    sub.norm = base.norm
    sub.rotary_emb = base.rotary_emb
    draft.lm_head = model.lm_head
    draft.generation_config = model.generation_config
    draft.eval()
    draft.set_attn_implementation(model.config._attn_implementation)
    return draft


class EarlyExitProposer(DraftModelProposer):
    """Self-speculation: the verifier's first ``num_layers`` layers draft for the whole model."""

    name = "early_exit"

    def __init__(self, model: PreTrainedModel, config: SinkWindowConfig, num_layers: int):
        self.num_layers = num_layers
        if registry.name_of(model) == "mlx":
            from kakeya_lab.backends.mlx_backend import mlx_early_exit_model

            draft = mlx_early_exit_model(model, num_layers)
        else:
            draft = early_exit_model(model, num_layers)
        super().__init__(draft, config, label=f"early-exit-{num_layers}")

    def describe(self) -> dict:
        return {"name": self.name, "num_layers": self.num_layers, "cache": self.config.to_dict()}


def build(argument: str, request: ProposerRequest) -> EarlyExitProposer:
    """``early-exit:LAYERS``: the verifier's first ``LAYERS`` layers."""
    return EarlyExitProposer(request.model, request.config, num_layers=int(argument))
