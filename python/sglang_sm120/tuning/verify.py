"""The exactness check every candidate passes before it is timed: each call's inputs and exact expected outputs,
and the comparison.

Exact: inputs are small integers with +0 and -0 among them (the kernels mark empty scratch with -0, so a real -0
must survive), built from the rank alone, so every rank can build every rank's inputs; their sums are exact in
bf16/fp16 in any order, and the fused case is built backwards from its expected residual so its norm is exact too.
Zero tolerance (+0 == -0 as values), and the ranks' bits are compared: a candidate fails everywhere when any rank
failed or the bits differ.

Every call its own inputs: a candidate that returns the previous call's result, reads the previous call's input
or reuses a buffer too early passes any check whose calls all see the same inputs. So call j of candidate c uses
the salt `salt(c) + j`, which rolls the base inputs (and the expected sum) and moves the fused pattern.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from sgl_kernel_sm120.policy import DTYPES
from sgl_kernel_sm120.reference import reference_all_reduce

EPS = 2.0 ** -20  # about the models' 1e-6; its effect on the expected norm rounds away
ROLL_STEP = 9973  # a prime: consecutive salts roll by different amounts


def salt(candidate_id: str) -> int:
    """The first salt of a candidate's calls: the same on every rank (a hash of its id, not Python's hash())."""
    return int(hashlib.sha256(candidate_id.encode()).hexdigest()[:8], 16)


def shift(value: int, numel: int) -> int:
    numel = max(1, int(numel))
    return (int(value) * (ROLL_STEP if ROLL_STEP % numel else 1)) % numel


def rank_input(rank: int, rows: int, hidden: int, dtype: str):
    """Rank `rank`'s base input: integers in [-3, 3], about one element in eight a -0."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    generator = torch.Generator().manual_seed(7919 * rank + rows)
    values = torch.randint(-3, 4, (rows, hidden), generator=generator).float()
    negative_zero = torch.randint(0, 8, (rows, hidden), generator=generator) == 0
    return torch.where(negative_zero, torch.full_like(values, -0.0), values).to(getattr(torch, dtype))


def fused_target(rows: int, hidden: int, phase: int = 0, device=None):
    """(R, its RMSNorm scale 2^-k) in float32. Each row of R holds +-2^(k+1) on every fourth element and signed
    zeros elsewhere, k = (row + phase) % 3, so mean(R^2) = 4^k and rsqrt(mean + eps) is 2^-k far within half an
    ulp; R * 2^-k * weight is a small integer times a power of two."""
    if hidden % 4:
        raise ValueError("hidden must be a multiple of 4")
    row = torch.arange(rows, device=device).unsqueeze(1) + int(phase)
    col = torch.arange(hidden, device=device).unsqueeze(0)
    k = (row % 3).float()
    sign = torch.where(((col // 4) + row) % 2 == 0, 1.0, -1.0)
    zero = torch.where((col + row) % 8 == 1, -0.0, 0.0)
    return torch.where(col % 4 == 0, sign * 2.0 ** (k + 1), zero), 2.0 ** -k


class CallBank:
    """One size's base case on `device`, for the ranks in `ranks` (every rank in one process, or this rank); a
    call's tensors are a roll, a subtraction and a product of it on the device, nothing random per call."""

    def __init__(self, kind: str, dtype: str, rows: int, hidden: int, world: int, ranks: Sequence[int], device):
        self.kind, self.dtype, self.rows, self.hidden = kind, dtype, int(rows), int(hidden)
        self.torch_dtype, self.numel, self.eps = getattr(torch, dtype), self.rows * self.hidden, EPS
        self.output_names = ("norm", "residual") if kind == "fused" else ("sum",)
        inputs = [rank_input(r, rows, hidden, dtype) for r in range(world)]
        self.total = reference_all_reduce(inputs).float().to(device)  # small integers: exact
        self.base = {r: inputs[r].to(device) for r in ranks}
        self.weight32 = self.weight = None
        if kind == "fused":
            self.weight32 = torch.tensor([(1, 2, 3, -1, -2)[i % 5] for i in range(hidden)], device=device).float()
            self.weight = self.weight32.to(self.torch_dtype)

    def _roll(self, t, value: int):
        return t.reshape(-1).roll(shift(value, self.numel)).reshape(self.rows, self.hidden)

    def inputs(self, value: int) -> dict[str, Any]:
        """{'x': {rank: input}, 'residual': the fused call's residual (the same on every rank) or None}."""
        residual = None
        if self.kind == "fused":  # R minus the sum: the residual the kernel adds to the sum to give R
            target, _ = fused_target(self.rows, self.hidden, value, self.total.device)
            residual = (target - self._roll(self.total, value)).to(self.torch_dtype)
        return {"x": {r: self._roll(base, value) for r, base in self.base.items()}, "residual": residual}

    def expected(self, value: int) -> tuple:
        """plain: (sum,); fused: (norm, residual)."""
        if self.kind == "plain":
            return (self._roll(self.total, value).to(self.torch_dtype),)
        target, scale = fused_target(self.rows, self.hidden, value, self.total.device)
        return (target * scale * self.weight32).to(self.torch_dtype), target.to(self.torch_dtype)


def mismatch(name: str, got, expected) -> str | None:
    """None when `got` equals `expected` exactly, else the first difference in words; compared on the CPU (the
    tuner's tensors live on the GPU)."""
    got, expected = got.detach().to("cpu"), expected.detach().to("cpu")
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"{name}: shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    g, e = got.float(), expected.float()
    bad = torch.isnan(g) | (g != e)
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{name}: {int(bad.sum())} of {bad.numel()} elements differ, first at {list(index)}: "
            f"got {g[index].item()}, expected {e[index].item()}")


def same_values(got, expected) -> bool:
    """`mismatch` is None, computed on the tensors' own device."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    g = got.float()
    return not bool((torch.isnan(g) | (g != expected.float())).any())


def fingerprint(tensors) -> str:
    """A digest of outputs computed where they are: a position-weighted sum of their 16-bit patterns, so one
    flipped bit (a zero's sign included) changes it. For comparing ranks' bits, not for security."""
    total = 0
    for t in tensors:
        bits = t.detach().contiguous().view(torch.int16).reshape(-1).to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        total = (total * 1_000_003 + int((bits * weights).sum().item())) % (1 << 61)
    return f"weighted:{total:x}"
