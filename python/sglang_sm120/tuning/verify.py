"""The exactness check every candidate passes before it is timed: one size's exact cases, built on the device, and
the comparison.

Exact: inputs are small integers with +0 and -0 among them (the kernels mark empty scratch with -0, so a real -0
must survive), a closed-form function of (case, rank, element), so every rank builds every rank's inputs; their sums
are exact in bf16/fp16 in any order, and the fused case is built backwards from its expected residual so its norm is
exact too. Zero tolerance (+0 == -0 as values), and the ranks' bits are compared: a candidate fails everywhere when
any rank failed or the bits differ.

Every call its own inputs: a candidate that returns the previous call's result, reads the previous call's input or
reuses a buffer too early passes any check whose calls all see the same inputs. So a size holds CASES x calls + 1
cases, and call k of replay b of candidate c runs case (salt(c) + b * calls + k) mod cases: consecutive calls,
and one slot's calls in consecutive replays, always differ.
"""

from __future__ import annotations

import hashlib

import torch

from sgl_kernel_sm120.policy import DTYPES

EPS = 2.0 ** -20  # about the models' 1e-6; its effect on the expected norm rounds away


def salt(candidate_id: str) -> int:
    """A candidate's first case offset: the same on every rank (a hash of its id, not Python's hash())."""
    return int(hashlib.sha256(candidate_id.encode()).hexdigest()[:8], 16)


def case_count(calls: int) -> int:
    """Cases per size for graphs of `calls` calls: one slot's cases in two consecutive replays differ."""
    return 2 * max(1, int(calls)) + 1


def rank_input(case: int, rank: int, rows: int, hidden: int, dtype: str, device=None):
    """Rank `rank`'s input of one case: integers in [-3, 3], about one element in eight a -0."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    i = torch.arange(rows * hidden, device=device, dtype=torch.int64).reshape(rows, hidden)
    h = (i * 2654435761 + (rank + 1) * 40503 + (case + 1) * 97) % 1000003
    values = (h % 7 - 3).float()
    negative_zero = (h // 7) % 8 == 0
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


class SizeBank:
    """One size's cases on `device` for the ranks `lanes` of this process (one rank, or every rank of a one-process
    group): `x[lane]` [cases, rows, hidden], the fused residual [cases, rows, hidden] (the same on every rank), and
    the expected outputs [cases, outputs, rows, hidden] (plain: the sum; fused: norm, residual)."""

    def __init__(self, kind: str, dtype: str, rows: int, hidden: int, world: int, lanes, device, cases: int):
        if kind not in ("plain", "fused"):
            raise ValueError(f"kind must be plain or fused, got {kind!r}")
        self.kind, self.dtype, self.rows, self.hidden, self.cases = kind, dtype, int(rows), int(hidden), int(cases)
        self.torch_dtype, self.eps = getattr(torch, dtype), EPS
        self.outputs = 2 if kind == "fused" else 1
        self.lanes = list(lanes)
        x = {lane: [] for lane in self.lanes}
        residuals, expected = [], []
        self.weight = torch.tensor([(1, 2, 3, -1, -2)[i % 5] for i in range(hidden)], device=device).to(
            self.torch_dtype) if kind == "fused" else None
        for case in range(self.cases):
            inputs = [rank_input(case, r, rows, hidden, dtype, device) for r in range(world)]
            total = torch.stack([t.float() for t in inputs]).sum(0)  # small integers: exact in any order
            for lane in self.lanes:
                x[lane].append(inputs[lane])
            if kind == "plain":
                expected.append(total.to(self.torch_dtype).unsqueeze(0))
                continue
            target, scale = fused_target(self.rows, self.hidden, case, device)
            residuals.append((target - total).to(self.torch_dtype))  # the kernel adds the sum back: exactly R
            expected.append(torch.stack([(target * scale * self.weight.float()).to(self.torch_dtype),
                                         target.to(self.torch_dtype)]))
        self.x = {lane: torch.stack(cases_) for lane, cases_ in x.items()}
        self.residual = torch.stack(residuals) if residuals else None
        self.expected = torch.stack(expected)


def wrong_elements(got, expected):
    """Per leading index, how many elements differ from `expected` (NaN counts), as a device tensor: no sync."""
    g = got.float()
    return (torch.isnan(g) | (g != expected.float())).reshape(got.shape[0], -1).sum(1)


def fingerprint(t):
    """A device scalar digest of `t`'s bits: a position-weighted sum of its 16-bit patterns, so one flipped bit (a
    zero's sign included) changes it. For comparing ranks' bits, not for security. No sync."""
    bits = t.detach().contiguous().view(torch.int16).reshape(-1).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return (bits * weights).sum()
