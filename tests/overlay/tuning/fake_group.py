"""A one-process group of fake workspaces on CPU tensors, and a backend that "captures" and replays their calls,
for running the tuner's verification and timing (tuning/burst.py) without a GPU.

A call completes when every rank has issued it (as the kernels' waits make it), reading the inputs then. The
fakes break the contract the way real bugs do:
- "stale": every call returns the previous call's result (a kernel reading the last call's packs);
- "single_buffer": correct while the host synchronizes between calls, but a call issued while the previous one
  is still in flight reuses that one's buffer, which then holds the new call's result (a broken double buffer);
- "zero_sign": rank 1 turns every +0 of its outputs into -0 (the same values, other bits than its peers');
- `wrong_rows`: at these row counts only, every output of rank 1 is off by one (a size-specific fault).
"""

from __future__ import annotations

import torch

from sgl_kernel_sm120 import policy

MODES = ("good", "stale", "single_buffer", "zero_sign")


class FakeGroup:
    def __init__(self, world: int, mode: str = "good", sm_budget: int = 16, clusters=(), wrong_rows=()):
        if mode not in MODES:
            raise ValueError(mode)
        self.world, self.mode, self.wrong_rows = world, mode, set(wrong_rows)
        self.workspaces = [FakeWorkspace(self, r, sm_budget, clusters) for r in range(world)]
        self.pending: dict[int, dict[int, tuple]] = {}
        self.previous: dict[int, tuple] = {}  # rank -> the last completed call's result (stale mode)
        self.in_flight: dict[int, tuple] = {}  # rank -> outputs of a call completed since the last sync
        self.launches: list = []  # the route of every call, rank 0's

    def synchronize(self) -> None:
        self.in_flight.clear()

    def issue(self, rank: int, index: int, call: tuple) -> None:
        self.pending.setdefault(index, {})[rank] = call
        if len(self.pending[index]) == self.world:
            self._complete(self.pending.pop(index))

    def _complete(self, calls: dict[int, tuple]) -> None:
        total = sum(calls[r][1].float() for r in range(self.world))
        for rank, (op, _x, outs, residual, weight, eps) in calls.items():
            if op == "plain":
                result = (total.to(outs[0].dtype),)
            else:
                res = total + residual.float()
                norm = res * torch.rsqrt(res.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
                result = (norm.to(outs[0].dtype), res.to(outs[1].dtype))
            written = result
            if self.mode == "stale":
                written = self.previous.get(rank, result)
                self.previous[rank] = tuple(t.clone() for t in result)
            if self.mode == "zero_sign" and rank == 1:
                written = tuple(torch.where(t == 0, torch.full_like(t, -0.0), t) for t in written)
            if rank == 1 and outs[0].shape[0] in self.wrong_rows:
                written = tuple(t + 1 for t in written)
            for out, value in zip(outs, written, strict=True):
                out.copy_(value)
            if self.mode == "single_buffer":
                earlier = self.in_flight.get(rank)
                if earlier is not None:
                    for out, value in zip(earlier, result, strict=True):
                        out.copy_(value)
                self.in_flight[rank] = outs


class FakeWorkspace:
    """What the measurer uses of an IpcAllReduce: its shape and limits, the one argument check (the real
    policy's decision on the route), and the two launches."""

    limits = policy.kernel_limits()

    def __init__(self, group: FakeGroup, rank: int, sm_budget: int, clusters):
        self.group, self.rank = group, rank
        self.shape = policy.WorkspaceShape(group.world, "device", "pcie", clusters=tuple(clusters),
                                           sm_budget=sm_budget)
        self.issued = 0
        self.recorded_timeout = None  # what a real workspace's host-mapped record would hold after a timed-out wait

    def timeout_error(self):
        return self.recorded_timeout

    def refusal(self, x, route, *, fused, residual=None, weight=None, outs=()):
        return policy.refusal(self.shape, route, x.numel() * x.element_size(), fused=fused, limits=self.limits)

    def _issue(self, call: tuple, route) -> None:
        if self.rank == 0:
            self.group.launches.append(route)
        index, self.issued = self.issued, self.issued + 1
        self.group.issue(self.rank, index, call)

    def launch(self, route, x, out):
        self._issue(("plain", x, (out,), None, None, None), route)
        return out

    def launch_fused_into(self, route, x, residual, weight, eps, norm_out, res_out):
        self._issue(("fused", x, (norm_out, res_out), residual, weight, eps), route)
        return norm_out, res_out


class FakeGraph:
    """Replays the lanes' calls call-major, as the lanes of a real graph run side by side."""

    def __init__(self, lanes):
        self.lanes = [list(lane) for lane in lanes]

    def replay(self) -> None:
        for k in range(len(self.lanes[0])):
            for lane in self.lanes:
                lane[k]()


class FakeBackend:
    """Replays synchronously on the CPU; a timer reads `us` (default 10) per replay."""

    def __init__(self, group: FakeGroup, us: float = 10.0):
        self.group, self.us = group, us
        self.captures = 0

    def synchronize(self) -> None:
        self.group.synchronize()

    def capture(self, lanes):
        self.captures += 1
        return FakeGraph(lanes)

    def timer(self):
        return (lambda: None), (lambda: None), (lambda: self.us)
