"""The pure-torch references (sgl_kernel_sm120/reference.py): the numerics the kernels promise."""

from __future__ import annotations

import torch

import sgl_kernel_sm120 as k


def test_reference_all_reduce_accumulates_in_fp32_and_rounds_once():
    # 256 + 1 + 1 in bf16: pairwise bf16 rounding would give 256 + 1 -> 256, then 256 + 1 -> 256.
    a = torch.tensor([256.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    assert k.reference_all_reduce([a, b, b]).item() == 258.0
    assert k.reference_all_reduce([a, b, b]).dtype == torch.bfloat16


def test_reference_fused_matches_float64_formula():
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
    residual = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    weight = torch.randn(64, generator=g).to(torch.bfloat16)
    norm, res = k.reference_all_reduce_add_rmsnorm(inputs, residual, weight, 1e-6)
    summed = sum(t.double() for t in inputs) + residual.double()
    assert torch.equal(res, summed.float().to(torch.bfloat16))  # one rounding of the fp32 sum
    r = res.double()
    expected = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert torch.allclose(norm.double(), expected, rtol=2**-7, atol=1e-6)
    assert norm.dtype == res.dtype == torch.bfloat16


def test_reference_fused_norm_starts_from_rounded_residual():
    # The RMSNorm uses residual_out as stored (rounded), like SGLang's unfused add + RMSNorm; from the unrounded
    # fp32 sum the result differs in some elements, so this distinguishes the two.
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 256, generator=g).to(torch.bfloat16) for _ in range(4)]
    residual = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    weight = torch.randn(256, generator=g).to(torch.bfloat16)
    norm, res = k.reference_all_reduce_add_rmsnorm(inputs, residual, weight, 1e-6)

    def rmsnorm(x):
        return ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * weight.float()).to(torch.bfloat16)

    unrounded = sum(t.float() for t in inputs) + residual.float()
    assert torch.equal(norm, rmsnorm(res.float()))
    assert not torch.equal(norm, rmsnorm(unrounded))
