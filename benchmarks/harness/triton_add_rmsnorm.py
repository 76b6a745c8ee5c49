"""A one-kernel residual add + RMSNorm in Triton: the benchmarks' fallback "unfused epilogue".

Used after an NCCL (or other plain) all-reduce when neither sgl_kernel's nor FlashInfer's
``fused_add_rmsnorm`` can run. Semantics follow SGLang's in-place ``fused_add_rmsnorm``:

    residual <- round(x + residual)                       (fp32 add, one rounding to the tensor dtype)
    x        <- round(rmsnorm_fp32(residual) * weight)     (norm computed from the *rounded* residual)

One program per row; the whole row (hidden <= 16384) sits in registers, so the row sum needs no atomics
and the result is deterministic. Outputs may alias inputs (in place) or be separate tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 16384


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        v = s.to(tl.float32)
    else:
        v = x
    mean_sq = tl.sum(v * v, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = v * rstd * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, out, residual_out, eps):
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden {hidden} > {MAX_HIDDEN}")
    x2 = x.view(-1, hidden)
    o2 = out.view(-1, hidden)
    for t in (x2, o2):
        if t.stride(-1) != 1:
            raise ValueError("last dimension must be contiguous")
    rows = x2.shape[0]
    if residual is not None:
        r2 = residual.view(-1, hidden)
        ro2 = residual_out.view(-1, hidden)
        args = (r2, ro2, r2.stride(0), ro2.stride(0))
    else:
        args = (x2, x2, 0, 0)  # unused
    block = triton.next_power_of_2(hidden)
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    if rows == 0:
        return
    _add_rmsnorm_kernel[(rows,)](
        x2,
        args[0],
        weight,
        o2,
        args[1],
        x2.stride(0),
        args[2],
        o2.stride(0),
        args[3],
        hidden,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> None:
    """In place, like SGLang's ``fused_add_rmsnorm``: residual <- x + residual; x <- rmsnorm(residual) * w."""
    _launch(x, residual, weight, x, residual, eps)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: returns (norm_out, residual_out); inputs are not written unless passed as outputs."""
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    _launch(x, residual, weight, out, residual_out, eps)
    return out, residual_out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain RMSNorm (no residual), out of place."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, out, None, eps)
    return out
