"""Model runtimes behind one seam: the sink-window cache on torch and on MLX.

* :mod:`~kakeya_lab.backends.config` — :class:`SinkWindowConfig` (no tensor runtime);
* :mod:`~kakeya_lab.backends.plan` — the backend-neutral slot plan: slots, key layout,
  visibility, rolling sink copies, eviction, positions and RoPE shifts (numpy);
* :mod:`~kakeya_lab.backends.seam` — the :class:`~kakeya_lab.backends.seam.Backend`
  protocol the verifier sits on;
* :mod:`~kakeya_lab.backends.registry` — backends by name, detected from a loaded model;
* ``torch_backend`` / ``torch_cache`` / ``torch_attention`` / ``torch_lean`` — the torch
  backend, its transformers cache, its attention mask and the lean forward of short blocks;
* ``mlx_backend`` — the MLX backend and its cache.

This package imports no tensor runtime; a backend's modules load when it is used.
"""

from kakeya_lab.backends.config import SinkWindowConfig

__all__ = ["SinkWindowConfig"]
