"""The interface every measured implementation has, and the Skip a failed set-up raises on every rank.

Every ``setup`` is staged so that ranks never diverge before a collective: local steps (imports, JIT builds)
run on every rank and are *agreed* (``Dist.attempt``) before any collective step (handle exchange) starts.
A failed peer raises ``Skip(reason)`` on every rank at the same point; the benchmark records it and goes on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from benchmarks.harness.ranks import Dist


class Skip(Exception):
    """Raised identically on every rank when an implementation cannot run here."""


class Impl:
    name = "?"
    inplace = False  # all_reduce writes its input (NCCL)
    accepts_out = True  # all_reduce(inp, out) writes into a preallocated out
    native_fused = False  # has its own all-reduce + add + RMSNorm

    def setup(self, d: Dist, max_numel: int) -> None:
        pass

    def variants(self) -> list[tuple[str | None, Any]]:
        """[(label, variant)] to measure; label None means 'whatever the implementation's dispatch picks'."""
        return [(None, None)]

    def dispatch_variant(self, nbytes: int) -> str | None:
        return None

    def supports(self, inp: torch.Tensor, fused: bool = False) -> bool:
        return True

    def prepare_shape(self, shape: tuple[int, ...]) -> None:
        """Collective per-shape preparation before capture (FlashInfer's prepare)."""

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None, variant: Any = None) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out, residual_out, variant=None):
        raise NotImplementedError

    def capture_context(self):
        return contextlib.nullcontext()

    def notes(self) -> dict:
        return {}

    def close(self) -> None:
        pass
