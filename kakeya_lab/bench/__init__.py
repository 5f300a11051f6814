"""Benchmarks: multi-turn session runs (``long_run``) and speculative decoding."""
