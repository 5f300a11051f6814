"""The names of the linear kernels a torch model's linear layers can run
(:mod:`kakeya_lab.linear`), importable without torch (command lines, spec checks)."""

from __future__ import annotations

KERNELS = ("aten", "onednn", "split", "exact", "auto", "int8", "int4", "int4-vnni")
FULL_PRECISION = ("aten", "onednn", "split", "exact")  # the kernels "auto" chooses from
