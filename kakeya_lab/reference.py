"""Reference oracles for the sink-window semantics (docs/design.md, "The sink-window cache").

These never use :class:`~kakeya_lab.backends.torch_cache.SinkWindowCache` nor the sink-window attention
path: they run transformers' own SDPA attention, so a test that compares an incremental
path against them compares two independent implementations.

* :func:`dense_logits` — one dense forward over the whole sequence with the sink-window
  mask (exact for ``global`` positions, and for ``rolling`` before the cache first fills).
* :func:`rolling_logits` — token-by-token decoding in the StreamingLLM way: the visible
  keys are re-rotated to their index inside the cache before every step.
* :func:`oracle_logits` — the oracle of a config's position mode (dense for ``global``,
  rolling for ``rolling``): what every incremental path must reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from kakeya_lab.backends.config import SinkWindowConfig
from kakeya_lab.backends.torch_attention import rotate, visibility
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


def rolling_logits(
    model: PreTrainedModel, token_ids: Sequence[int] | torch.Tensor, config: SinkWindowConfig
) -> torch.Tensor:
    """Next-token logits ``[n, vocab]`` by single-token decoding (:class:`RollingReference`).

    With ``positions="rolling"`` this is the rolling-mode oracle; with ``"global"`` it is
    the global single-token path (equal to :func:`dense_logits` up to float error).
    """
    return RollingReference(model, config).extend(token_ids)


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
