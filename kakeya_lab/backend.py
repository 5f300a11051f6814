"""The backend seam: what the :class:`~kakeya_lab.verifier.Verifier` needs from a model
runtime, and the PyTorch implementation.

A backend owns one model and one sink-window cache for one sequence. It feeds blocks of
token ids at the next positions, keeps them provisional until :meth:`Backend.commit`
(eviction happens there and nowhere else) or drops them with :meth:`Backend.rollback`, and
reports the cache's state. Logits always come back as float32 ``torch`` tensors, so
everything above the verifier (sessions, proposers, speculative decoding, benches) is the
same code on every backend.

* :class:`TorchBackend` — transformers model + :class:`~kakeya_lab.cache.SinkWindowCache`.
* :class:`kakeya_lab.mlx_backend.MLXBackend` — mlx-lm model + its MLX sink-window cache.

:func:`make_backend` picks one from the model's type.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
from transformers import PreTrainedModel

from kakeya_lab.cache import SinkWindowCache, SinkWindowConfig, cache_kwarg
from kakeya_lab.draft_step import MAX_TOKENS, LeanForward
from kakeya_lab.tree import DraftTree

BACKENDS = ("torch", "mlx")


@dataclass
class Forward:
    """What one forward returns: ``logits`` float32 ``[rows, vocab]`` (the last row only,
    or one row per token) and, when asked for, the final hidden states (the lm_head's input)
    float32 ``[len(token_ids), hidden]`` (every row)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@runtime_checkable
class Backend(Protocol):
    """One model + one sink-window cache for one sequence.

    ``forward(ids, all_rows=..., hidden=...)`` appends ``ids`` at positions
    ``next_position, next_position + 1, ...`` as provisional entries; if it raises, the
    backend is as it was before the call (earlier provisional entries included).
    ``commit(n)`` keeps the first ``n`` provisional entries and evicts; ``rollback()``
    drops them all. With ``tree`` (a :class:`~kakeya_lab.tree.DraftTree` of
    ``token_ids``, no provisional entries open) token ``i`` sits at ``next_position +
    depth(i)`` and sees, among the block, only its ancestors; ``select(path)`` then
    keeps a root-to-node path as the first provisional entries (before ``commit``).
    """

    name: str
    config: SinkWindowConfig
    vocab_size: int

    def forward(
        self,
        token_ids: Sequence[int],
        *,
        all_rows: bool,
        hidden: bool = False,
        tree: DraftTree | None = None,
    ) -> Forward: ...

    def select(self, indices: Sequence[int]) -> None: ...

    def commit(self, n: int) -> None: ...

    def rollback(self) -> None: ...

    def reset(self) -> None: ...

    @property
    def cache_len(self) -> int: ...

    @property
    def pending_len(self) -> int: ...

    @property
    def next_position(self) -> int: ...

    def cached_positions(self) -> list[int]: ...

    def kv_live_bytes(self) -> int: ...

    def kv_budget_bytes(self) -> int | None: ...

    @property
    def cache(self) -> Any:
        """The backend's cache object (its type depends on the backend)."""
        ...


def backend_name_of(model: Any) -> str:
    """``"torch"`` for a torch module, ``"mlx"`` for an mlx module; ValueError otherwise."""
    if isinstance(model, torch.nn.Module):
        return "torch"
    module = type(model).__module__
    try:
        import mlx.nn
    except ImportError:
        mlx_module = None
    else:
        mlx_module = mlx.nn.Module
    if mlx_module is not None and isinstance(model, mlx_module):
        return "mlx"
    raise ValueError(
        f"cannot tell the backend of a {type(model).__name__} (from {module}): pass a transformers "
        "PreTrainedModel (kakeya_lab.load_model) or an mlx-lm model (kakeya_lab.mlx_backend.load_mlx_model)"
    )


def vocab_size_of(model: Any) -> int:
    """How many token ids ``model`` accepts (``0..vocab_size-1``), on either backend: the
    rows of a torch model's input embedding, an mlx-lm model's ``args.vocab_size``."""
    if backend_name_of(model) == "mlx":
        return int(model.args.vocab_size)
    # torch types any submodule attribute as ``Tensor | Module``; this one is an int.
    return cast(int, model.get_input_embeddings().num_embeddings)


def proposer_backend(proposer: Any) -> str | None:
    """The backend a proposer computes on (``None``: no model, e.g. n-gram lookup).

    Read from ``proposer.backend`` when it says; else from the verifier a draft-model
    proposer drafts with, or the drafter module a hidden-state proposer runs."""
    named = getattr(proposer, "backend", None)
    if isinstance(named, str):
        return named
    draft_verifier = getattr(proposer, "verifier", None)
    if draft_verifier is not None and isinstance(
        getattr(draft_verifier, "backend_name", None), str
    ):
        return draft_verifier.backend_name
    drafter = getattr(proposer, "drafter", None)
    if drafter is not None:
        return backend_name_of(drafter)
    return None


def check_same_backend(verifier_backend: str, proposer: Any) -> None:
    """Raise ValueError if ``proposer`` computes on another backend than the verifier."""
    theirs = proposer_backend(proposer)
    if theirs is not None and theirs != verifier_backend:
        raise ValueError(
            f"the proposer {getattr(proposer, 'name', type(proposer).__name__)!r} runs on {theirs} but the "
            f"verifier on {verifier_backend}: load the draft model (or drafter) on the same backend"
        )


def make_backend(
    model: Any,
    config: SinkWindowConfig,
    block_padding: Mapping[int, int] | None = None,
    lean_forward: LeanForward | None = None,
) -> Backend:
    """The backend for ``model``: :class:`TorchBackend` or :class:`~kakeya_lab.mlx_backend.MLXBackend`
    (``block_padding`` and ``lean_forward``, see :class:`~kakeya_lab.verifier.Verifier`:
    torch only)."""
    if backend_name_of(model) == "torch":
        return TorchBackend(model, config, block_padding, lean_forward)
    if lean_forward is not None:
        raise ValueError("a lean forward runs on the torch backend only")
    if block_padding and any(n != m for n, m in block_padding.items()):
        raise ValueError("block padding is implemented on the torch backend only")
    from kakeya_lab.mlx_backend import MLXBackend

    return MLXBackend(model, config)


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output feeds the lm_head (the final norm of the decoder stack)."""
    norm = getattr(model.base_model, "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__} has no final norm at model.base_model.norm")
    return norm


class CacheBackend:
    """The cache verbs every backend answers by asking its sink-window cache (``self.cache``);
    a backend adds ``forward`` and ``cached_positions``."""

    cache: Any

    def commit(self, n: int) -> None:
        self.cache.commit(n)

    def select(self, indices: Sequence[int]) -> None:
        self.cache.select(indices)

    def rollback(self) -> None:
        self.cache.rollback()

    def reset(self) -> None:
        self.cache.reset()

    @property
    def cache_len(self) -> int:
        return self.cache.cache_len

    @property
    def pending_len(self) -> int:
        return self.cache.pending_len

    @property
    def next_position(self) -> int:
        return self.cache.next_position

    def kv_live_bytes(self) -> int:
        return self.cache.kv_live_bytes()

    def kv_budget_bytes(self) -> int | None:
        return self.cache.kv_budget_bytes()


class TorchBackend(CacheBackend):
    """A transformers causal LM over a :class:`SinkWindowCache` (``auto_commit=False``);
    with ``lean_forward`` (a :class:`~kakeya_lab.draft_step.LeanForward` of the same model,
    for draft models) short blocks that need no hidden states run through it instead."""

    name = "torch"

    def __init__(
        self,
        model: PreTrainedModel,
        config: SinkWindowConfig,
        block_padding: Mapping[int, int] | None = None,
        lean_forward: LeanForward | None = None,
    ):
        from kakeya_lab.attention import enable_sink_window_attention

        if lean_forward is not None and lean_forward.model is not model:
            raise ValueError("lean_forward must be built from the same model")
        enable_sink_window_attention(model)
        self.model = model
        self.config = config
        self.vocab_size = vocab_size_of(model)
        self.device = next(model.parameters()).device
        self.cache = SinkWindowCache(model, config, auto_commit=False)
        self.block_padding = dict(block_padding or {})
        self.lean_forward = lean_forward

    def forward(
        self,
        token_ids: Sequence[int],
        *,
        all_rows: bool,
        hidden: bool = False,
        tree: DraftTree | None = None,
    ) -> Forward:
        ids = list(token_ids)
        start = self.cache.next_position
        n = len(ids)
        # a chain block scored at a cheaper larger size: the padding (the last token again)
        # comes after every real row, so no real row sees it, and is dropped afterwards
        pad = self.block_padding.get(n, n) - n if all_rows and tree is None else 0
        lean = self.lean_forward
        if lean is not None and tree is None and not hidden and not pad and n <= MAX_TOKENS:
            try:
                return Forward(lean(self.cache, ids, all_rows=all_rows), None)
            except BaseException:
                self.cache.crop(start)  # drop this forward's partial block only
                raise
        input_ids = torch.tensor([ids + ids[-1:] * pad], dtype=torch.long, device=self.device)
        captured: list[torch.Tensor] = []
        hook = None
        if hidden:
            hook = final_norm(self.model).register_forward_hook(
                lambda _m, _i, out: captured.append(out[0].detach().float())
            )
        shape = self.cache.tree_forward(tree) if tree is not None else nullcontext(None)
        try:
            with torch.inference_mode(), shape as tree_positions:
                if tree_positions is None:
                    positions = torch.arange(start, start + n + pad, device=self.device)[None]
                else:
                    positions = tree_positions.to(self.device)[None]
                out = self.model(
                    input_ids=input_ids,
                    position_ids=positions,
                    **cache_kwarg(self.model, self.cache),
                    use_cache=True,
                    logits_to_keep=0 if all_rows else 1,
                )
            if pad:
                self.cache.crop(start + n)
        except BaseException:
            self.cache.crop(start)  # drop this forward's partial block only
            raise
        finally:
            if hook is not None:
                hook.remove()
        hidden_rows = captured[-1][:n] if captured else None
        return Forward(out.logits[0, : n if all_rows else 1].float(), hidden_rows)

    def cached_positions(self) -> list[int]:
        return self.cache.cached_positions().tolist()
