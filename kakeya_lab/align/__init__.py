"""Proposer alignment: verifier rollouts, trainable drafters, training and evaluation.

* :mod:`~kakeya_lab.align.rollouts` — capture the verifier's tokens, top-k logits and
  hidden states into ``datasets`` shards;
* :mod:`~kakeya_lab.proposers.drafters.network` — ``FeatureDrafter`` (EAGLE-style), ``BlockDrafter``
  (block-diffusion style, after DFlash) and ``LoraDrafter`` (a distilled draft model);
* :mod:`~kakeya_lab.align.losses` — KL to the verifier's top-k, smooth-L1 on features,
  cross-entropy on the verifier's tokens;
* :mod:`~kakeya_lab.align.train` — the seeded training loop with safetensors checkpoints;
* :mod:`~kakeya_lab.align.evaluate` — held-out acceptance, ``tau`` and speedup by domain.
"""
