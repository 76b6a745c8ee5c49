"""Pure-torch references of the two ops, with the numerics the kernels promise (docs/design.md, "Numerics")."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _fp32_sum(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    if not inputs:
        raise ValueError("need at least one input")
    return sum((t.float() for t in inputs[1:]), inputs[0].float())


def reference_all_reduce(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of every rank's input (index = rank), fp32 in rank order, rounded once to the input dtype."""
    return _fp32_sum(inputs).to(inputs[0].dtype)


def reference_add_rmsnorm(summed_fp32: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_out, residual_out) from an fp32 sum: residual_out = round(sum + residual), norm from it."""
    residual_out = (summed_fp32 + residual.float()).to(residual.dtype)
    r = residual_out.float()
    inv_rms = torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((r * inv_rms) * weight.float()).to(residual.dtype), residual_out


def reference_all_reduce_add_rmsnorm(inputs: Sequence[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's reference: all-reduce in fp32, then add + RMSNorm, each rounding once."""
    return reference_add_rmsnorm(_fp32_sum(inputs), residual, weight, eps)
