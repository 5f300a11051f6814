"""Reference oracles for the sink-window semantics (docs/design.md, "The sink-window cache").

These never use :class:`~kakeya_lab.backends.torch_cache.SinkWindowCache` nor the
sink-window attention path: they run transformers' own SDPA attention (or, for
:func:`rolling_logits`, this module's own), so a test that compares an incremental path
against them compares two independent implementations.

* :func:`dense_logits` — one dense forward over the whole sequence with the sink-window
  mask (exact for ``global`` positions, and for ``rolling`` before the cache first fills).
* :class:`RollingReference` — token-by-token decoding in the StreamingLLM way: the visible
  keys are re-rotated to their index inside the cache before every step (the rolling rule
  as written; it can fork and continue a sequence).
* :func:`rolling_logits` — the same logits from one forward over the whole sequence: the
  sink-window mask, and each query rotated back to its index inside the cache where it
  meets the sinks (the only keys whose distance rolling positions change). Held to
  :class:`RollingReference` by ``tests/test_oracle.py``.
* :func:`oracle_logits` — the oracle of a config's position mode (dense for ``global``,
  rolling for ``rolling``): what every incremental path must reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.torch_attention import rotate, standard_attention, visibility
from kakeya_lab.backends.torch_cache import cache_kwarg, rope_inv_freq


def _ids(token_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(list(token_ids) if not isinstance(token_ids, torch.Tensor) else token_ids)
    return ids.reshape(1, -1).to(device=device, dtype=torch.long)


def sink_window_mask(n: int, config: SinkWindowConfig) -> torch.Tensor:
    """The oracle's boolean mask ``[n, n]`` (True = attend) for positions ``0..n-1``."""
    positions = torch.arange(n)
    return visibility(positions, positions, config.sink, config.window)


@torch.inference_mode()
def dense_logits(
    model: PreTrainedModel, token_ids: Sequence[int] | torch.Tensor, config: SinkWindowConfig
) -> torch.Tensor:
    """Next-token logits ``[n, vocab]`` for every position of ``token_ids``, dense + masked.

    For ``rolling`` positions this is exact only while the sequence fits the budget
    (``n <= sink + window``); longer sequences raise — use :func:`rolling_logits`.
    """
    device = next(model.parameters()).device
    ids = _ids(token_ids, device)
    n = ids.shape[1]
    if config.positions == "rolling" and config.budget is not None and n > config.budget:
        raise ValueError(
            f"rolling positions differ from the dense mask past the budget ({config.budget}); "
            "use reference.rolling_logits"
        )
    mask = sink_window_mask(n, config).to(device)[None, None]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=torch.arange(n, device=device)[None],
        use_cache=False,
    )
    return out.logits[0].float()


class RollingReference:
    """Single-token decoding under the sink-window rule, StreamingLLM style.

    Before step ``p`` the visible tokens are the sinks and the ``window - 1`` previous
    tokens. In ``rolling`` mode they are placed at consecutive cache indices ``0..m-1``
    (keys re-rotated from their absolute position) and the query at index ``m``; in
    ``global`` mode everything keeps its absolute position. Keys are stored rotated at
    their absolute position between steps. :meth:`extend` continues the sequence;
    :meth:`copy` forks it (to score a provisional block without changing the original).
    """

    def __init__(self, model: PreTrainedModel, config: SinkWindowConfig):
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.inv_freq = rope_inv_freq(model).to(self.device)
        self.keys: list[list[torch.Tensor]] = []  # per layer, per token [1, kv, 1, d]
        self.values: list[list[torch.Tensor]] = []
        self.length = 0

    def copy(self) -> RollingReference:
        twin = RollingReference.__new__(RollingReference)
        twin.__dict__.update(self.__dict__)
        twin.keys = [list(k) for k in self.keys]
        twin.values = [list(v) for v in self.values]
        return twin

    @torch.inference_mode()
    def extend(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Feed ``token_ids`` one at a time; next-token logits ``[n, vocab]``."""
        config, device, inv_freq = self.config, self.device, self.inv_freq
        rows = []
        for token in _ids(token_ids, device)[0]:
            p = self.length
            context = [
                j
                for j in range(p)
                if j < config.sink or config.window is None or p - j < config.window
            ]
            rolling = config.positions == "rolling"
            targets = list(range(len(context))) if rolling else context
            query_index = len(context) if rolling else p
            cache = DynamicCache()
            if context:
                shift = torch.tensor([t - j for t, j in zip(targets, context)], device=device)
                for layer, (k_layer, v_layer) in enumerate(zip(self.keys, self.values)):
                    k = torch.cat([k_layer[j] for j in context], dim=2)
                    v = torch.cat([v_layer[j] for j in context], dim=2)
                    if bool((shift != 0).any()):
                        k = rotate(k, shift, inv_freq)
                    cache.update(k, v, layer)
            out = self.model(
                input_ids=token.reshape(1, 1),
                position_ids=torch.tensor([[query_index]], device=device),
                **cache_kwarg(self.model, cache),
                use_cache=True,
            )
            rows.append(out.logits[0, -1].float())
            for layer in range(len(cache.layers)):
                if layer >= len(self.keys):
                    self.keys.append([])
                    self.values.append([])
                layer_keys, layer_values = _layer_storage(cache, layer)
                k_new = layer_keys[:, :, -1:]
                if query_index != p:
                    k_new = rotate(k_new, torch.tensor([p - query_index], device=device), inv_freq)
                self.keys[layer].append(k_new.clone())
                self.values[layer].append(layer_values[:, :, -1:].clone())
            self.length += 1
        return torch.stack(rows)


# The attention of :func:`rolling_logits`' one forward: the config and the model's RoPE
# frequencies of the forward running it.
_ROLLING_ATTENTION = "kakeya_rolling_oracle"
_rolling: ContextVar[tuple[SinkWindowConfig, torch.Tensor]] = ContextVar("kakeya_rolling")


def _rolling_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a forward over positions ``0..n-1`` under the rolling rule.

    Query ``p`` sees the sinks and its window (``attention_mask``). Its cache holds them at
    indices ``0..m-1`` with itself at ``m = min(p, sink + window - 1)``: a window key keeps
    its distance ``p - j``, a sink ``j`` is at distance ``m - j``. RoPE scores depend only on
    distance, so the sinks' scores take the query rotated by ``m - p``.
    """
    config, inv_freq = _rolling.get()
    n = query.shape[2]
    positions = torch.arange(n, device=query.device)
    groups = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1).float()
    values = value.repeat_interleave(groups, dim=1).float()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = query.float() @ keys.transpose(-1, -2) * scale
    if config.window is not None and config.sink > 0:
        index = positions.clamp(max=config.sink + config.window - 1)
        moved = rotate(query, index - positions, inv_freq).float()
        sinks = keys[:, :, : config.sink]
        scores[..., : sinks.shape[2]] = moved @ sinks.transpose(-1, -2) * scale
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise RuntimeError("the rolling oracle's forward takes its boolean sink-window mask")
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    out = scores.softmax(dim=-1) @ values
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(_ROLLING_ATTENTION, _rolling_attention)
AttentionMaskInterface.register(_ROLLING_ATTENTION, sdpa_mask)


@torch.inference_mode()
def rolling_logits(
    model: PreTrainedModel, token_ids: Sequence[int] | torch.Tensor, config: SinkWindowConfig
) -> torch.Tensor:
    """Next-token logits ``[n, vocab]`` of single-token decoding under ``config``
    (:class:`RollingReference`'s, to float error), from one forward over the sequence.

    With ``positions="rolling"`` this is the rolling-mode oracle; with ``"global"`` it is
    :func:`dense_logits`. The model runs this module's own attention for the forward (its
    previous implementation is restored after it), so it must not be running other forwards
    meanwhile.
    """
    if config.positions == "global":
        return dense_logits(model, token_ids, config)
    device = next(model.parameters()).device
    ids = _ids(token_ids, device)
    n = ids.shape[1]
    token = _rolling.set((config, rope_inv_freq(model).to(device)))
    try:
        with standard_attention(model, _ROLLING_ATTENTION):
            out = model(
                input_ids=ids,
                attention_mask=sink_window_mask(n, config).to(device)[None, None],
                position_ids=torch.arange(n, device=device)[None],
                use_cache=False,
            )
    finally:
        _rolling.reset(token)
    return out.logits[0].float()


def oracle_logits(
    model: PreTrainedModel, token_ids: Sequence[int] | torch.Tensor, config: SinkWindowConfig
) -> torch.Tensor:
    """Next-token logits ``[n, vocab]`` that the sink-window cache must give under ``config``:
    :func:`dense_logits` for ``positions="global"``, :func:`rolling_logits` for
    ``"rolling"`` (valid at any length, past the budget too)."""
    if config.positions == "global":
        return dense_logits(model, token_ids, config)
    return rolling_logits(model, token_ids, config)


def _layer_storage(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(keys, values)`` a forward left in one attention layer of ``cache``."""
    entry = cache.layers[layer]
    if not isinstance(entry, CacheLayerMixin) or entry.keys is None or entry.values is None:
        raise RuntimeError(f"cache layer {layer} ({type(entry).__name__}) holds no keys/values")
    return entry.keys, entry.values
