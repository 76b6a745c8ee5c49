"""CPU fakes of the kernel workspace and of a TP backend, for unit tests of dispatch and fusion logic."""

from __future__ import annotations

import torch


class FakeIpcAllReduce:
    """Stands in for sgl_kernel_sm120.IpcAllReduce on CPU: "all-reduces" by multiplying by world_size (what
    identical inputs on every rank would sum to)."""

    instances: list[FakeIpcAllReduce] = []

    def __init__(self, group=None, device=None, max_numel=0, dtype=torch.bfloat16, *, islands=None, link="auto",
                 timeout_s=None, world_size=2, fail=None):
        if fail:
            raise RuntimeError(fail)
        self.group, self.device, self.max_numel, self.dtype = group, device, int(max_numel), dtype
        self.islands, self.link, self.world_size = islands, link, world_size
        self.closed = False
        self.calls: list[str] = []
        FakeIpcAllReduce.instances.append(self)

    def supports(self, inp: torch.Tensor) -> bool:
        return (
            not self.closed
            and inp.dtype in (torch.bfloat16, torch.float16)
            and inp.is_contiguous()
            and 0 < inp.numel() <= self.max_numel
            and inp.numel() % 8 == 0
        )

    def supports_add_rmsnorm(self, inp: torch.Tensor) -> bool:
        return self.supports(inp) and inp.dim() == 2

    def all_reduce(self, inp, out=None):
        self.calls.append("all_reduce")
        return (inp.float() * self.world_size).to(inp.dtype)

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out=None, residual_out=None):
        self.calls.append("all_reduce_add_rmsnorm")
        residual_out = (inp.float() * self.world_size + residual.float()).to(inp.dtype)
        r = residual_out.float()
        norm = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(inp.dtype)
        return norm, residual_out

    def calls_completed(self) -> int:
        # the real one counts on the device, graph replays included; here every call is an eager one
        return len(self.calls)

    def close(self, *, collective=True, barrier_timeout_s=None):
        self.closed = True
        self.closed_collectively = collective


class FakeGroupCoordinator:
    """What the fallback path needs of a GroupCoordinator: all_reduce (sums identical inputs)."""

    def __init__(self, world_size: int = 2):
        self.world_size = world_size
        self.all_reduce_calls = 0

    def all_reduce(self, inp):
        self.all_reduce_calls += 1
        return (inp.float() * self.world_size).to(inp.dtype)
