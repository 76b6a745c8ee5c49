"""The residual add + RMSNorm kernels of the unfused paths (the epilogue after a plain all-reduce), and the
fp32 reference every kernel is checked against."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .io import setup_import_paths


def reference_add_rmsnorm(x, residual, weight, eps):
    """fp32 reference of the fused op's contract: residual_out rounded once, norm from the rounded value."""
    import torch

    res = (x.float() + residual.float()).to(x.dtype) if residual is not None else x
    v = res.float()
    norm = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return norm, res


@dataclass
class NormKernel:
    """add_rmsnorm_(x, residual, w, eps): in place, residual <- x + residual, x <- rmsnorm(residual) * w.
    rmsnorm(x, w, eps) -> new tensor."""

    name: str
    add_rmsnorm_: Callable
    rmsnorm: Callable


def torch_norm_kernel() -> NormKernel:
    """Unfused torch ops with the reference numerics (CPU emulation in tests; last-resort fallback)."""

    def add_(x, r, w, eps):
        n, s = reference_add_rmsnorm(x, r, w, eps)
        r.copy_(s)
        x.copy_(n)

    def rms(x, w, eps):
        return reference_add_rmsnorm(x, None, w, eps)[0]

    return NormKernel("torch (unfused reference ops)", add_, rms)


def _norm_candidates() -> list[tuple[str, Callable[[], NormKernel]]]:
    def sgl():
        mod = importlib.import_module("sgl_kernel")
        return NormKernel("sgl_kernel.fused_add_rmsnorm", mod.fused_add_rmsnorm, mod.rmsnorm)

    def flashinfer():
        mod = importlib.import_module("flashinfer.norm")
        return NormKernel("flashinfer.norm.fused_add_rmsnorm", mod.fused_add_rmsnorm, mod.rmsnorm)

    def triton_():
        setup_import_paths()
        mod = importlib.import_module("benchmarks.harness.triton_add_rmsnorm")
        return NormKernel("triton (benchmarks/harness/triton_add_rmsnorm.py)", mod.fused_add_rmsnorm, mod.rmsnorm)

    return [("sgl_kernel", sgl), ("flashinfer", flashinfer), ("triton", triton_), ("torch", torch_norm_kernel)]


def _validate_norm(k: NormKernel, device, hidden: int, eps: float) -> None:
    import torch

    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randint(-4, 5, (3, hidden), generator=g).to(torch.bfloat16).to(device)
    r = torch.randint(-4, 5, (3, hidden), generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(device)
    ref_n, ref_r = reference_add_rmsnorm(x, r, w, eps)
    ref_plain = reference_add_rmsnorm(x, None, w, eps)[0]
    plain = k.rmsnorm(x.clone(), w, eps)
    k.add_rmsnorm_(x, r, w, eps)
    torch.cuda.synchronize()
    if not torch.equal(r, ref_r):
        raise RuntimeError("residual output differs from reference")
    if not torch.allclose(x.float(), ref_n.float(), rtol=1 / 64, atol=1 / 64):
        raise RuntimeError(f"norm output differs from reference (max {(x.float() - ref_n.float()).abs().max():.3g})")
    if plain is None or not torch.allclose(plain.float(), ref_plain.float(), rtol=1 / 64, atol=1 / 64):
        raise RuntimeError("plain rmsnorm differs from reference")


def select_norm_kernel(d, hidden: int, eps: float, prefer: str | None = None) -> tuple[NormKernel, list]:
    """First of sgl_kernel / flashinfer / triton / torch that imports AND computes correctly on every rank
    (stand-in modules that raise when called are rejected here). Returns (kernel, [(name, reason) rejected])."""
    cands = _norm_candidates()
    if prefer:
        cands = [c for c in cands if c[0] == prefer] + [c for c in cands if c[0] != prefer]
    rejected = []
    for name, make in cands:

        def attempt(make=make):
            k = make()
            _validate_norm(k, d.device, hidden, eps)
            return k

        ok, k, why = d.attempt(attempt, name)
        if ok:
            return k, rejected
        rejected.append((name, why))
    raise RuntimeError(f"no add+rmsnorm kernel works: {rejected}")
