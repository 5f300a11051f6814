"""Trainable drafters that condition on the verifier's hidden states.

Both read the verifier's *final hidden state* ``f_j`` (the lm_head input) at the latest
context positions, paired with the token that followed, ``(f_j, t_{j+1})``, and predict
the features ``f_p, f_{p+1}, ...`` of the positions to come, where ``t_p`` is the last
token emitted and ``p`` its position. The verifier's frozen lm_head turns a predicted
feature into logits, restricted to ``draft_vocab`` (the tokens the rollouts actually use:
most of a head's cost is its vocabulary). The verifier's frozen embedding embeds tokens.
Neither frozen matrix is part of a drafter's checkpoint.

* :class:`FeatureDrafter` (EAGLE-style): a small causal decoder over the pairs; drafts
  autoregressively, feeding back its own predicted feature with the token it chose.
* :class:`BlockDrafter` (block-diffusion style, after DFlash): bidirectional layers over
  the context pairs and ``draft_length`` learned mask slots; one forward fills the whole block.
  Learnable bridges map the verifier's width to the drafter's narrower one and back.

:mod:`kakeya_lab.proposers.drafters.proposer` makes either one a proposer of the
speculative-decoding protocol; :mod:`kakeya_lab.align` trains them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from kakeya_lab.backends.torch_attention import rotate
from kakeya_lab.sampling import GREEDY, SamplingConfig
from kakeya_lab.tree import DraftTree

if TYPE_CHECKING:
    from kakeya_lab.proposers.drafters.lora import LoraDrafter

KINDS = ("feature", "block", "lora")


@dataclass
class DrafterConfig:
    """Shape of a drafter and the verifier it belongs to (saved beside its weights)."""

    kind: str  # "feature" or "block"
    hidden_size: int  # the verifier's width H (features, embedding, lm_head)
    vocab_size: int  # the verifier's vocabulary
    verifier_sha256: str | None  # weights of the verifier it was made for
    draft_vocab: list[int] = field(default_factory=list)  # token ids it may propose
    width: int = 0  # the drafter's own width (0: the verifier's)
    num_layers: int = 1
    num_heads: int = 8
    mlp_ratio: float = 2.0
    context_len: int = 16  # (feature, next token) pairs it reads
    block_size: int = 4  # block drafter: mask slots, the longest draft of one forward
    rope_theta: float = 10000.0
    base: str = ""  # lora: the draft model adapted, "early-exit:LAYERS" (of the verifier)
    lora_rank: int = 16
    lora_alpha: float = 32.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}: use one of {', '.join(KINDS)}")
        self.width = self.width or self.hidden_size
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        if self.context_len < 1 or self.block_size < 1 or self.num_layers < 1:
            raise ValueError("context_len, block_size and num_layers must be >= 1")
        if not self.draft_vocab:
            self.draft_vocab = list(range(self.vocab_size))
        bad = [t for t in self.draft_vocab if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"draft_vocab holds ids outside 0..{self.vocab_size - 1}: {bad[:5]}")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(x: torch.Tensor, theta: float, start: int = 0) -> torch.Tensor:
    """Rotary position embedding over the sequence axis of ``x`` ``[B, heads, L, d]``
    (positions ``start..start+L-1``; the rotation is :func:`kakeya_lab.backends.torch_attention.rotate`)."""
    L, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    return rotate(x, torch.arange(start, start + L, device=x.device), inv_freq)


# One layer's keys and values so far (RoPE applied), ``[B, heads, P, d]`` each.
LayerKV = tuple[torch.Tensor, torch.Tensor]


class Layer(nn.Module):
    """Pre-norm transformer layer: multi-head attention with RoPE, SwiGLU MLP."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float, rope_theta: float):
        super().__init__()
        self.num_heads, self.rope_theta = num_heads, rope_theta
        self.attn_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        hidden = int(width * mlp_ratio)
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        return self.extend(x, None, causal)[0]

    def extend(
        self, x: torch.Tensor, past: LayerKV | None, causal: bool
    ) -> tuple[torch.Tensor, LayerKV]:
        """``x`` ``[B, L, W]`` at the positions after ``past`` (the keys and values of the
        rows before, or None): the layer's output and the keys and values of all rows.
        With ``past``, ``L`` must be 1 (one new row sees every earlier row and itself), so
        row by row this equals :meth:`forward` of a causal layer over the whole sequence."""
        B, L, W = x.shape
        start = 0 if past is None else past[0].shape[2]
        if past is not None and L != 1:
            raise ValueError(f"extend a cached layer by one row at a time, got {L}")
        q, k, v = (
            self.qkv(self.attn_norm(x)).view(B, L, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        )
        q, k = rope(q, self.rope_theta, start), rope(k, self.rope_theta, start)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=causal and past is None)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, W))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), (k, v)


class Drafter(nn.Module):
    """What both drafters share: frozen embedding and head, the pair fusion, the layers."""

    causal: bool
    # buffers (register_buffer), typed for the checker
    embedding: torch.Tensor
    head: torch.Tensor
    draft_ids: torch.Tensor
    draft_index: torch.Tensor

    def __init__(self, config: DrafterConfig, embedding: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        c = self.config = config
        if embedding.shape != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"verifier embedding is {tuple(embedding.shape)}, the drafter expects "
                f"{(c.vocab_size, c.hidden_size)}"
            )
        ids = torch.tensor(c.draft_vocab, dtype=torch.long)
        # Frozen, shared with the verifier, never saved with the drafter.
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.register_buffer("head", lm_head.detach()[ids].float().clone(), persistent=False)
        self.register_buffer("draft_ids", ids, persistent=False)
        index = torch.full((c.vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        self.register_buffer("draft_index", index, persistent=False)  # token id -> head row
        self.fuse = nn.Linear(2 * c.hidden_size, c.width, bias=False)  # (feature, token) -> width
        self.layers = nn.ModuleList(
            Layer(c.width, c.num_heads, c.mlp_ratio, c.rope_theta) for _ in range(c.num_layers)
        )
        self.norm = RMSNorm(c.width)
        self.out = nn.Linear(c.width, c.hidden_size, bias=False)  # back to the verifier's width
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
                if name.endswith(("proj.weight", "down.weight")):
                    p.data.mul_(1 / math.sqrt(2 * self.config.num_layers))

    def embed_pairs(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, n, H]`` features ``f_j`` and ``[B, n]`` tokens ``t_{j+1}`` -> ``[B, n, width]``."""
        emb = self.embedding[next_tokens].to(features.dtype)
        return self.fuse(torch.cat([features, emb], dim=-1))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, self.causal)
        return self.out(self.norm(x))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over ``draft_vocab`` from (predicted) features."""
        return features @ self.head.T

    def predict(
        self, window_features: torch.Tensor, window_tokens: torch.Tensor, draft_length: int
    ):
        """Training view of a window of ``n + k + 1`` positions ``s..s+n+k`` (``n`` =
        ``context_len``, ``k`` = ``draft_length``, ``p = s + n``): the context pairs are ``(f_j, t_{j+1})`` for
        ``j < p``. Returns predicted features ``[B, m, H]`` and the window offsets ``[m]``
        they predict (the feature at offset ``o`` yields the token at ``o + 1``)."""
        raise NotImplementedError

    @torch.no_grad()
    def draft(
        self,
        features: torch.Tensor,
        next_tokens: Sequence[int],
        draft_length: int,
        sampling: SamplingConfig = GREEDY,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Draft ``draft_length`` tokens after the context; returns ids and, when sampling, ``q`` per draft."""
        raise NotImplementedError

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig, generator):
        """One token from draft-vocab ``logits``; returns (token id, full-vocab q or None)."""
        if sampling.greedy:
            return int(self.draft_ids[int(torch.argmax(logits))]), None
        full = torch.full((self.config.vocab_size,), float("-inf"))
        full[self.draft_ids] = logits.float()
        q = sampling.probs(full)
        return int(torch.multinomial(q, 1, generator=generator)), q


class FeatureDrafter(Drafter):
    """EAGLE-style: a causal decoder layer over ``(f_j, t_{j+1})`` pairs; output ``j``
    predicts ``f_{j+1}``. Drafts one token per step, feeding back its own feature: the
    context pairs go through the layers once, and each step adds one row per path against
    the cached keys and values (:meth:`_extend`)."""

    causal = True

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: predicted ``f_{j+1}`` for every pair ``j`` (``[B, n, H]``)."""
        return self.run(self.embed_pairs(features, next_tokens))

    def predict(self, window_features, window_tokens, draft_length):
        """Every context pair teacher-forced (offsets ``1..n``), then ``k - 1`` steps
        (``k`` = ``draft_length``) unrolled on its own features with the verifier's tokens
        (offsets ``n+1..n+k-1``), as when drafting (the training-time test of EAGLE-3)."""
        n, k = self.config.context_len, draft_length
        feats, toks = window_features[:, :n], window_tokens[:, 1 : n + 1]
        out = self.forward(feats, toks)
        preds = [out]
        for i in range(1, k):
            feats = torch.cat([feats, preds[-1][:, -1:]], dim=1)
            toks = torch.cat([toks, window_tokens[:, n + i : n + i + 1]], dim=1)
            preds.append(self.forward(feats, toks)[:, -1:])
        return torch.cat(preds, dim=1), torch.arange(1, n + k)

    def _extend(
        self, features: torch.Tensor, tokens: torch.Tensor, past: list[LayerKV] | None
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """Pairs ``features`` ``[B, L, H]`` / ``tokens`` ``[B, L]`` after each path's
        ``past`` (every layer's keys and values so far; None: the pairs start the
        sequence, and then any ``L``; else ``L`` = 1): the feature predicted after the last
        pair ``[B, H]`` and the grown past. Row for row the numbers of :meth:`forward`
        over the whole path, without recomputing what came before."""
        x = self.embed_pairs(features, tokens)
        grown: list[LayerKV] = []
        for i, layer in enumerate(self.layers):
            x, kv = cast(Layer, layer).extend(x, None if past is None else past[i], causal=True)
            grown.append(kv)
        return self.out(self.norm(x[:, -1])), grown

    def _prefill(
        self, features: torch.Tensor, next_tokens: Sequence[int]
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """The context pairs through the layers once (one path)."""
        toks = torch.tensor([list(next_tokens)], dtype=torch.long)
        return self._extend(features[None].float(), toks, None)

    @torch.no_grad()
    def draft(self, features, next_tokens, draft_length, sampling=GREEDY, generator=None):
        """Autoregressive drafting on the drafter's own features; the context goes through
        the layers once and each draft extends their keys and values (:meth:`_extend`)."""
        out, qs = [], []
        if draft_length < 1:
            return out, None
        pred, past = self._prefill(features, next_tokens)
        for i in range(draft_length):
            token, q = self._choose(self.logits(pred[0]), sampling, generator)
            out.append(token)
            if q is not None:
                qs.append(q)
            if i + 1 < draft_length:
                pred, past = self._extend(pred[:, None], torch.tensor([[token]]), past)
        return out, (torch.stack(qs) if qs else None)

    @torch.no_grad()
    def draft_tree(
        self, features: torch.Tensor, next_tokens: Sequence[int], max_nodes: int, branch: int = 4
    ) -> DraftTree:
        """EAGLE-2's dynamic tree: at most ``max_nodes`` nodes continuing the context.

        Depth by depth, the ``branch`` likeliest paths so far (by the product of the
        drafter's probabilities along them) are extended in one batched forward, each by
        its ``branch`` likeliest tokens; the tree is then the ``max_nodes`` likeliest
        nodes of all scored. A path's probability never exceeds its parent's, so the
        likeliest nodes always include their ancestors (ties go to the shallower node).
        Deterministic (``probs`` None): greedy and rejection-sampling verifiers take it.
        """
        if max_nodes < 1:
            return DraftTree.empty()
        pred, past = self._prefill(features, next_tokens)  # [1, H]: one path, the context
        scores = torch.zeros(1)  # log-probability of each frontier path
        frontier = [-1]  # their node ids (-1: the context)
        nodes: list[tuple[float, int, int, int]] = []  # (log p, depth, token, parent node)
        for depth in range(max_nodes):
            logp = torch.log_softmax(self.logits(pred), dim=-1)  # [B, draft vocab]
            top = torch.topk(logp, min(branch, logp.shape[-1]), dim=-1)
            width = top.indices.shape[1]
            cand = (scores[:, None] + top.values).flatten()  # [B * width]
            first = len(nodes)
            tokens = self.draft_ids[top.indices].flatten().tolist()
            for i, (logp_i, token) in enumerate(zip(cand.tolist(), tokens)):
                nodes.append((logp_i, depth, token, frontier[i // width]))
            # the next frontier: this depth's likeliest paths, if any can still make the tree
            order = torch.argsort(cand, descending=True)[:branch]
            floor = sorted(n[0] for n in nodes)[-max_nodes] if len(nodes) >= max_nodes else None
            order = order[[floor is None or float(cand[i]) >= floor for i in order.tolist()]]
            if len(order) == 0 or depth + 1 == max_nodes:
                break
            rows = order // width
            chosen = self.draft_ids[top.indices.flatten()[order]]
            past = [(k[rows], v[rows]) for k, v in past]
            pred, past = self._extend(pred[rows][:, None], chosen[:, None], past)
            scores = cand[order]
            frontier = [first + int(i) for i in order]
        best = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1], i))[:max_nodes]
        slot = {node: k for k, node in enumerate(best)}
        return DraftTree(
            [nodes[i][2] for i in best],
            [-1 if nodes[i][3] < 0 else slot[nodes[i][3]] for i in best],
        )


class BlockDrafter(Drafter):
    """Block-diffusion style: bidirectional layers over the context pairs followed by
    ``draft_length`` learned mask slots; slot ``i`` predicts ``f_{p+i}``, all in one forward."""

    causal = False

    def __init__(self, config: DrafterConfig, embedding: torch.Tensor, lm_head: torch.Tensor):
        super().__init__(config, embedding, lm_head)
        self.mask_slots = nn.Parameter(torch.randn(config.block_size, config.width) * 0.02)

    def forward(
        self, features: torch.Tensor, next_tokens: torch.Tensor, draft_length: int
    ) -> torch.Tensor:
        """Predicted features of the ``draft_length`` positions after the context pairs."""
        k = draft_length
        if not 1 <= k <= self.config.block_size:
            raise ValueError(
                f"a block drafter fills 1..{self.config.block_size} slots, asked for {k}"
            )
        ctx = self.embed_pairs(features, next_tokens)
        slots = self.mask_slots[:k].to(ctx.dtype).expand(ctx.shape[0], -1, -1)
        return self.run(torch.cat([ctx, slots], dim=1))[:, -k:]

    def predict(self, window_features, window_tokens, draft_length):
        n = self.config.context_len
        pred = self.forward(window_features[:, :n], window_tokens[:, 1 : n + 1], draft_length)
        return pred, torch.arange(n, n + draft_length)

    @torch.no_grad()
    def draft(self, features, next_tokens, draft_length, sampling=GREEDY, generator=None):
        k = min(draft_length, self.config.block_size)
        toks = torch.tensor([list(next_tokens)], dtype=torch.long)
        logits = self.logits(self.forward(features[None].float(), toks, k)[0])
        out, qs = [], []
        for row in logits:  # slots are filled independently; one forward for the block
            token, q = self._choose(row, sampling, generator)
            out.append(token)
            if q is not None:
                qs.append(q)
        return out, (torch.stack(qs) if qs else None)


def drafter_config_for(
    kind: str, loaded, draft_vocab: Sequence[int] = (), **shape
) -> DrafterConfig:
    """A :class:`DrafterConfig` of ``kind`` sized for the verifier ``loaded``; ``shape``
    overrides the defaults (e.g. ``width``, ``num_layers``, ``context_len``, ``base``)."""
    model = loaded.model
    return DrafterConfig(
        kind=kind,
        hidden_size=model.config.hidden_size,
        vocab_size=model.get_input_embeddings().num_embeddings,
        verifier_sha256=loaded.description.weight_sha256,
        draft_vocab=list(draft_vocab),
        **shape,
    )


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a drafter trains (what its checkpoints hold)."""
    return {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}


if TYPE_CHECKING:
    # Feature/block drafters share the Drafter base; the LoRA drafter has the same surface.
    AnyDrafter = Drafter | LoraDrafter


def build_drafter(config: DrafterConfig, verifier_model) -> AnyDrafter:
    """A fresh drafter for ``verifier_model`` (frozen embedding and lm_head taken from it)."""
    emb = verifier_model.get_input_embeddings().weight.detach().float()
    head = verifier_model.get_output_embeddings().weight.detach().float()
    if config.kind == "lora":
        from kakeya_lab.proposers.drafters.lora import LoraDrafter

        lora = LoraDrafter(config, verifier_model)
        lora.eval()
        return lora
    cls = FeatureDrafter if config.kind == "feature" else BlockDrafter
    drafter = cls(config, emb, head)
    drafter.eval()
    return drafter
