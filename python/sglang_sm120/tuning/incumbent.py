"""What a fused call runs when NCCL serves it: NCCL's all-reduce, then SGLang's own fused residual-add + RMSNorm,
the kernel its RMSNorm layer calls (sgl_kernel's `fused_add_rmsnorm`; FlashInfer's where sgl_kernel is missing),
so the tuner times the real alternative to our fused op. A torch composition is the last resort, and the table
names whichever ran.

Every candidate has the in-place contract of those kernels: `fn(x, residual, weight, eps)` leaves
residual <- x + residual and x <- rmsnorm(residual) * weight.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def _torch_add_rmsnorm(x, residual, weight, eps):
    import torch

    summed = (x.float() + residual.float()).to(x.dtype)
    v = summed.float()
    residual.copy_(summed)
    x.copy_((v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype))


def find_fused_add_rmsnorm() -> tuple[str, Callable]:
    """(name, in-place fused add + RMSNorm) of the first kernel that imports."""
    for module, attribute in (("sgl_kernel", "fused_add_rmsnorm"), ("flashinfer.norm", "fused_add_rmsnorm")):
        try:
            return f"{module}.{attribute}", getattr(importlib.import_module(module), attribute)
        except Exception:  # noqa: BLE001 - missing, or broken on this GPU: try the next
            continue
    return "torch ops (sgl_kernel and flashinfer not importable)", _torch_add_rmsnorm
