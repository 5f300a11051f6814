"""The verifier: a causal LM over a sink-window cache, with provisional blocks.

``append`` commits tokens and returns the next-token logits; ``forward_block`` scores a
provisional block (logits for every position) that ``commit(n)`` keeps in part and
``rollback()`` drops. Every forward gives each position the oracle's context (the
attention mask is built from positions, see :mod:`kakeya_lab.attention`), so a block, a
chunked append and token-by-token decoding agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from kakeya_lab import attention
from kakeya_lab.cache import SinkWindowCache, SinkWindowConfig


def vocab_size_of(model: PreTrainedModel) -> int:
    """Rows of the input embedding: the valid token ids are ``0..vocab_size-1``."""
    return model.get_input_embeddings().num_embeddings


def check_token_ids(token_ids: Sequence[int] | torch.Tensor, vocab_size: int) -> list[int]:
    """Return ``token_ids`` as a list of ints, or raise ``ValueError`` saying what is wrong."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.reshape(-1).tolist()
    if isinstance(token_ids, (str, bytes)):
        raise TypeError("token ids must be a sequence of integers, not a string (tokenize it first)")
    ids = list(token_ids)
    if not ids:
        raise ValueError("empty token ids: nothing to append")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{len(bad)} token id(s) outside the vocabulary 0..{vocab_size - 1}: {bad[:5]}"
        )
    return ids


class Verifier:
    """Scores tokens for one sequence through a :class:`SinkWindowCache`.

    ``prefill_chunk`` bounds how many tokens go through one forward in :meth:`append`
    (chunking does not change the result; it bounds the memory of a long prefill).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: SinkWindowConfig,
        *,
        prefill_chunk: int = 512,
    ):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        attention.enable_sink_window_attention(model)
        self.model = model
        self.config = config
        self.prefill_chunk = prefill_chunk
        self.vocab_size = vocab_size_of(model)
        self.device = next(model.parameters()).device
        self.cache = SinkWindowCache(model, config, auto_commit=False)
        self._history: list[int] = []
        self._pending: list[int] = []

    # ---------------------------------------------------------------- forwards
    def _forward(self, ids: list[int], logits_to_keep: int) -> torch.Tensor:
        start = self.cache.next_position
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=input_ids,
                    position_ids=positions,
                    past_key_values=self.cache,
                    use_cache=True,
                    logits_to_keep=logits_to_keep,
                )
        except BaseException:
            # Drop this forward's partial block; earlier provisional tokens survive.
            self.cache.crop(start)
            raise
        return out.logits[0].float()

    def append(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Commit ``token_ids`` and return the next-token logits ``[vocab]`` after them."""
        ids = check_token_ids(token_ids, self.vocab_size)
        if self._pending:
            raise RuntimeError("a provisional block is open: commit(n) or rollback() first")
        logits = None
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i : i + self.prefill_chunk]
            logits = self._forward(chunk, logits_to_keep=1)[-1]
            self.cache.commit(len(chunk))
            self._history.extend(chunk)
        return logits

    def forward_block(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Score a provisional block: logits ``[k, vocab]``, row ``i`` predicting after ``ids[:i+1]``.

        Nothing is committed or evicted; a second call extends the open block.
        """
        ids = check_token_ids(token_ids, self.vocab_size)
        logits = self._forward(ids, logits_to_keep=0)
        self._pending.extend(ids)
        return logits

    def commit(self, n: int) -> None:
        """Keep the first ``n`` tokens of the open block, drop the rest (then evict)."""
        if not 0 <= n <= len(self._pending):
            raise ValueError(f"commit({n}) but the open block has {len(self._pending)} tokens")
        self.cache.commit(n)
        self._history.extend(self._pending[:n])
        self._pending = []

    def rollback(self) -> None:
        """Drop the open block; the committed history and cache are unchanged."""
        self.cache.rollback()
        self._pending = []

    # ------------------------------------------------------------------- state
    @property
    def kv_live_bytes(self) -> int:
        return self.cache.kv_live_bytes()

    @property
    def cache_len(self) -> int:
        """Committed entries held by the cache (``<= sink + window``)."""
        return self.cache.cache_len

    @property
    def history_len(self) -> int:
        """Committed tokens since the start."""
        return len(self._history)

    @property
    def pending_len(self) -> int:
        return len(self._pending)

    @property
    def history_token_ids(self) -> list[int]:
        return list(self._history)

    @property
    def cached_token_ids(self) -> list[int]:
        """Ids of the committed entries the cache holds, in position order."""
        return [self._history[p] for p in self.cache.cached_positions().tolist()]

    def cached_positions(self) -> list[int]:
        return self.cache.cached_positions().tolist()
