"""Trained drafters, the inference side: the networks (:mod:`.network`: feature, block and
LoRA drafters reading the verifier's hidden states), their checkpoints (:mod:`.checkpoint`),
the store's named drafters (:mod:`.named`) and their proposers (:mod:`.proposer`,
``drafter:NAME`` and ``drafter-tree:NAME``). :mod:`kakeya_lab.align` trains them."""
