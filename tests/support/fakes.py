"""CPU fakes of the kernel workspace and of a TP backend, for unit tests of dispatch and fusion logic."""

from __future__ import annotations

import torch

from sgl_kernel_sm120 import policy
from sgl_kernel_sm120.errors import IpcAllReduceProbeError
from sgl_kernel_sm120.policy import Link, Route, WorkspaceShape


class FakeIpcAllReduce:
    """Stands in for sgl_kernel_sm120.IpcAllReduce on CPU: "all-reduces" by multiplying by world_size (what
    identical inputs on every rank would sum to). It launches nothing, but what it runs is decided as the real one
    decides it: by sgl_kernel_sm120.policy with the limits of the library the tests load (read when this module is
    imported, before a test may stand a fake package in for sgl_kernel_sm120).

    Mirrors the constructor's `memory` argument: "device" keeps the given link, "host" reports
    `link == Link.HOST` and refuses islands, as the real one does. `failing(...)` makes a subclass whose device
    builds raise IpcAllReduceProbeError (and, optionally, whose host builds fail too), for the retry logic."""

    instances: list[FakeIpcAllReduce] = []
    limits = policy.kernel_limits()
    # Set on the subclasses `failing()` makes: the probe table a device build fails with, and the error text a
    # host build fails with.
    probe_pairs: list[tuple[int, int, str]] | None = None
    host_error: str | None = None
    host_error_type: type[Exception] = RuntimeError
    # What the real workspace reports about the fused one-shot's cluster launch (agreed over the group).
    fused_clusters = {"clusters": [8, 4, 2], "reason": "fake: clusters assumed to work"}
    sm_budget = 188
    use_pdl = True
    warn_after_s, timeout_s = 5.0, 300.0

    def __init__(self, group=None, device=None, max_numel=0, dtype=torch.bfloat16, *, islands=None, link="auto",
                 memory="device", timeout_s=None, warn_after_s=None, on_timeout="trap", world_size=2, fail=None):
        attempts = type(self).__dict__.get("attempts")
        if attempts is not None:
            attempts.append(memory)
        if fail:
            raise RuntimeError(fail)
        if memory not in ("device", "host"):
            raise ValueError(f"memory must be 'device' or 'host', got {memory!r}")
        if memory == "host" and islands is not None:
            raise ValueError("islands must be None with memory='host' (host memory has no islands)")
        if memory == "device" and self.probe_pairs:
            raise IpcAllReduceProbeError(list(self.probe_pairs))
        if memory == "host" and self.host_error:
            raise self.host_error_type(self.host_error)
        self.group, self.device, self.max_numel, self.dtype = group, device, int(max_numel), dtype
        self.memory, self.world_size = memory, world_size
        self.islands = islands
        self.num_islands = len(islands) if islands else 1
        self.link = Link.HOST if memory == "host" else Link(link if link in ("nvlink", "pcie") else "pcie")
        self.shape = WorkspaceShape(world_size, memory, self.link, self.num_islands,
                                    clusters=tuple(self.fused_clusters["clusters"]), sm_budget=self.sm_budget)
        self.closed = False
        self.calls: list[str] = []
        self.routes_run: list[Route] = []  # the route of every call, in order
        FakeIpcAllReduce.instances.append(self)

    @classmethod
    def failing(cls, probe_pairs=((1, 0, "dropped"),), host_error: str | None = None,
                host_error_type: type[Exception] = RuntimeError) -> type[FakeIpcAllReduce]:
        """A subclass whose device-memory builds raise IpcAllReduceProbeError(probe_pairs) (None: they succeed)
        and whose host-memory builds raise host_error_type(host_error) when given. `attempts` lists the memory of
        every construction, successful or not, in call order (all ranks together)."""
        return type("FailingFakeIpcAllReduce", (cls,), {
            "probe_pairs": list(probe_pairs) if probe_pairs else None,
            "host_error": host_error,
            "host_error_type": host_error_type,
            "attempts": [],
        })

    def describe_fused_launch(self) -> str:
        return f"over {'/'.join(map(str, self.fused_clusters['clusters']))}-CTA clusters (fake)"

    def supports(self, inp: torch.Tensor) -> bool:
        return (
            not self.closed
            and inp.dtype in (torch.bfloat16, torch.float16)
            and inp.is_contiguous()
            and 0 < inp.numel() <= self.max_numel
            and inp.numel() % 8 == 0
        )

    def admits_fused(self, rows: int, hidden: int, dtype) -> bool:
        return (not self.closed and dtype in (torch.bfloat16, torch.float16) and 0 < rows * hidden <= self.max_numel
                and hidden % 8 == 0)

    def supports_add_rmsnorm(self, inp: torch.Tensor, residual=None, weight=None) -> bool:
        if not (self.supports(inp) and inp.dim() == 2):
            return False
        if residual is not None and (residual.shape != inp.shape or residual.dtype != inp.dtype
                                     or residual.device != inp.device):
            return False
        return weight is None or (tuple(weight.shape) == (inp.shape[-1],) and weight.dtype == inp.dtype
                                  and weight.device == inp.device)

    def launch(self, route: Route, inp, out=None):
        self.calls.append("all_reduce")
        self.routes_run.append(route)
        return (inp.float() * self.world_size).to(inp.dtype)

    def launch_fused(self, route: Route, inp, residual, weight, eps, norm_out=None, residual_out=None):
        self.calls.append("all_reduce_add_rmsnorm")
        self.routes_run.append(route)
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
