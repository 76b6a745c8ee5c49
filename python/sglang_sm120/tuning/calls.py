"""The inputs and exact expected outputs of every call a candidate's verification makes, different for every call
and every candidate, built on the device from one base case per size.

A candidate that returns the previous call's result, reads the previous call's input or lets one call's buffers
be reused by the next before it is done passes any check whose calls all see the same inputs. So call `j` of
candidate `c` gets the salt `salt(c) + j` (`salt` hashes the candidate's id: every rank derives the same one),
and from it
- every rank's input: the base input of tuning/verify.py rolled (flattened) by `shift(salt)` places; consecutive
  salts roll by different amounts (by 9973 places more, a prime, or by 1 where the element count divides it), so
  the sums differ;
- plain: the expected sum, the base sum rolled the same way (a roll commutes with the sum: still exact);
- fused: the expected residual R of phase `salt` (verify.fused_target, whose rows change with the phase), the
  residual handed in as R minus the rolled sum, and the expected norm R * 2^-k * weight, all small integers
  times powers of two: exact in bf16 and fp16.
Nothing is random per call: a base input is built once per size (on the CPU, from the seed and the rank), and a
call's tensors are a roll, a subtraction and a product of it on the device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from . import verify

ROLL_STEP = 9973


def salt(candidate_id: str) -> int:
    """The first salt of a candidate's calls: the same on every rank (a hash of its id, not Python's hash())."""
    return int(hashlib.sha256(candidate_id.encode()).hexdigest()[:8], 16)


def shift(value: int, numel: int) -> int:
    numel = max(1, int(numel))
    step = ROLL_STEP if ROLL_STEP % numel else 1
    return (int(value) * step) % numel


class CallBank:
    """One size's base case on `device`, for the ranks in `ranks` (every rank in one process, or this rank)."""

    def __init__(self, kind: str, dtype: str, rows: int, hidden: int, world: int, ranks: Sequence[int], device,
                 seed: int = 0):
        import torch

        if kind not in ("plain", "fused"):
            raise ValueError(f"kind must be plain or fused, got {kind!r}")
        self.kind, self.dtype, self.rows, self.hidden = kind, dtype, int(rows), int(hidden)
        self.torch_dtype = getattr(torch, dtype)
        inputs = [verify.rank_input(r, rows, hidden, dtype, seed) for r in range(world)]
        total = inputs[0].float()
        for x in inputs[1:]:
            total = total + x.float()
        self.total = total.to(device)  # small integers: exact in float32
        self.base = {r: inputs[r].to(device) for r in ranks}
        self.numel = self.rows * self.hidden
        self.eps = verify.EPS
        if kind == "fused":
            self.weight32 = verify.fused_weight(hidden, device)
            self.weight = self.weight32.to(self.torch_dtype)

    def _roll(self, t, value: int):
        return t.reshape(-1).roll(shift(value, self.numel)).reshape(self.rows, self.hidden)

    def inputs(self, value: int) -> dict[str, Any]:
        """{'x': {rank: input}, 'residual': the fused call's residual (the same on every rank) or None}."""
        x = {r: self._roll(base, value) for r, base in self.base.items()}
        residual = None
        if self.kind == "fused":
            target, _ = verify.fused_target(self.rows, self.hidden, value, self.total.device)
            residual = (target - self._roll(self.total, value)).to(self.torch_dtype)
        return {"x": x, "residual": residual}

    def expected(self, value: int) -> tuple:
        """plain: (sum,); fused: (norm, residual)."""
        if self.kind == "plain":
            return (self._roll(self.total, value).to(self.torch_dtype),)
        target, scale = verify.fused_target(self.rows, self.hidden, value, self.total.device)
        return (target * scale * self.weight32).to(self.torch_dtype), target.to(self.torch_dtype)

    def output_names(self) -> tuple[str, ...]:
        return ("norm", "residual") if self.kind == "fused" else ("sum",)
