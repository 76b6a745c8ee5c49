"""Benchmarks of the sglang-sm120 all-reduce kernels (run with torchrun; see README.md)."""
