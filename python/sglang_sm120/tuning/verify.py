"""The exactness check every candidate passes before it is timed.

Inputs are small integers, with +0 and -0 among them (the kernels mark empty scratch with -0, so a real -0
must survive: csrc/ar_protocol.cuh), built on the CPU from (seed, rank) alone: every rank can build every rank's
inputs and the exact expected result. Sums of a few small integers are exact in bf16/fp16 whatever the order.

The fused case is built backwards from its expected residual R: each row holds +-b on every fourth element and
(signed) zeros elsewhere, b = 2^(k+1) with k = row % 3, so mean(R^2) = 4^k and rsqrt(mean + eps) is 2^-k up to
a relative error far below half an ulp of bf16/fp16; R * 2^-k * weight is a small integer times a power of two,
so the expected norm is exact too. The residual handed to the kernel is R minus the sum of the ranks' inputs.

The check has zero tolerance (values equal, no NaN; +0 == -0 as values), and every rank's output bytes are
digested: `reduce_verdicts` fails a candidate when any rank failed or the ranks' outputs differ in any bit.
torch is needed (CPU is enough); nothing here touches a GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

EPS = 2.0 ** -20  # about 1e-6, like the models'; its effect on the expected norm rounds away (docstring)
_DTYPES = ("bfloat16", "float16")


def _dtype(name: str):
    import torch

    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {name!r}")
    return getattr(torch, name)


def rank_input(rank: int, rows: int, hidden: int, dtype: str, seed: int = 0):
    """Rank `rank`'s input: integers in [-3, 3], about one element in eight a -0."""
    import torch

    generator = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + rows)
    values = torch.randint(-3, 4, (rows, hidden), generator=generator).float()
    negative_zero = torch.randint(0, 8, (rows, hidden), generator=generator) == 0
    values = torch.where(negative_zero, torch.full_like(values, -0.0), values)
    return values.to(_dtype(dtype))


def plain_case(world: int, rows: int, hidden: int, dtype: str, seed: int = 0):
    """(every rank's input, the exact sum)."""
    inputs = [rank_input(r, rows, hidden, dtype, seed) for r in range(world)]
    total = inputs[0].float()
    for x in inputs[1:]:
        total = total + x.float()
    return inputs, total.to(_dtype(dtype))


def fused_target(rows: int, hidden: int, phase: int = 0, device=None):
    """(R, its row scale 2^-k) in float32: the expected residual of a fused call and what its RMSNorm multiplies
    by (docstring). `phase` moves the pattern, so calls of another phase expect other bits in every row."""
    import torch

    if hidden % 4:
        raise ValueError("hidden must be a multiple of 4")
    row = torch.arange(rows, device=device).unsqueeze(1) + int(phase)
    col = torch.arange(hidden, device=device).unsqueeze(0)
    k = (row % 3).float()
    magnitude = 2.0 ** (k + 1)
    sign = torch.where(((col // 4) + row) % 2 == 0, 1.0, -1.0)
    zero = torch.where((col + row) % 8 == 1, -0.0, 0.0)
    return torch.where(col % 4 == 0, sign * magnitude, zero), 2.0 ** -k


def fused_weight(hidden: int, device=None):
    import torch

    return torch.tensor([(1, 2, 3, -1, -2)[i % 5] for i in range(hidden)], dtype=torch.float32, device=device)


def fused_case(world: int, rows: int, hidden: int, dtype: str, seed: int = 0):
    """(every rank's input, residual, weight, eps, expected norm, expected residual) of the fused op."""
    inputs = [rank_input(r, rows, hidden, dtype, seed) for r in range(world)]
    target, scale = fused_target(rows, hidden)
    total = inputs[0].float()
    for x in inputs[1:]:
        total = total + x.float()
    residual = (target - total).to(_dtype(dtype))  # small integers: exact
    weight = fused_weight(hidden)
    norm = target * scale * weight
    return inputs, residual, weight.to(_dtype(dtype)), EPS, norm.to(_dtype(dtype)), target.to(_dtype(dtype))


def mismatch(name: str, got, expected) -> str | None:
    """None when `got` equals `expected` exactly (as values, on the CPU), else the first difference in words. Both
    are moved to the CPU: the tuner's outputs and its expected values live on the GPU."""
    import torch

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
    """`mismatch` on the tensors' own device, without moving them: True when equal as values with no NaN."""
    import torch

    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    g = got.float()
    return not bool((torch.isnan(g) | (g != expected.float())).any())


def fingerprint(tensors) -> str:
    """A digest of many outputs computed where they are: a position-weighted sum of their 16-bit patterns, so one
    flipped bit anywhere (the sign of a zero included) changes it. For comparing ranks' bits, not for security."""
    import torch

    total = 0
    for t in tensors:
        bits = t.detach().contiguous().view(torch.int16).reshape(-1).to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        total = (total * 1_000_003 + int((bits * weights).sum().item())) % (1 << 61)
    return f"weighted:{total:x}"


def output_digest(*tensors) -> str:
    """sha256 of the tensors' bytes (every bit, the sign of zero included)."""
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reduce_verdicts(gathered: Sequence[tuple[str | None, str | None]]) -> str | None:
    """Every rank's (error or None, output digest), rank order -> the group's verdict: None (passed) or why not.
    Pure: every rank computes the same verdict from the same gathered list."""
    errors = [f"rank {r}: {err}" for r, (err, _) in enumerate(gathered) if err]
    if errors:
        return "; ".join(errors)
    digests = [d for _, d in gathered]
    if len(set(digests)) != 1:
        groups: dict[Any, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        return "outputs differ across ranks (ranks with identical bits: " + ", ".join(
            str(ranks) for ranks in groups.values()) + ")"
    return None
