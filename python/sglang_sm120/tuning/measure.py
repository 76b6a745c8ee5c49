"""One rank's CUDA side of a tune (the Tuner's measurer): the workspace, our candidates' check and timing
(tuning/burst.py), and NCCL's timing. The workspace waits with on_timeout="exit" and a short bound, so a candidate
that hangs on this fabric fails in seconds and leaves the CUDA context usable; after any failure the Tuner calls
`reset()` on every rank and the next candidate builds a fresh workspace.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sgl_kernel_sm120.policy import KernelLimits, Route, WorkspaceShape

from ..routing.table import route_id
from . import timing
from .burst import CandidateRun, CudaBackend
from .verify import CallBank

logger = logging.getLogger("sglang_sm120")

CLOSE_BARRIER_S = 30.0


def _torch_add_rmsnorm(x, residual, weight, eps):
    from sgl_kernel_sm120.reference import reference_add_rmsnorm

    norm, summed = reference_add_rmsnorm(x.float(), residual, weight, eps)
    residual.copy_(summed)
    x.copy_(norm)


def find_fused_add_rmsnorm() -> tuple[str, Callable]:
    """(name, kernel) the fused kind's incumbent runs after NCCL: SGLang's RMSNorm layer's own (sgl_kernel's, else
    FlashInfer's; torch ops as the last resort, named in the table). In place: `fn(x, residual, weight, eps)` leaves
    residual <- x + residual and x <- rmsnorm(residual) * weight."""
    for module, attribute in (("sgl_kernel", "fused_add_rmsnorm"), ("flashinfer.norm", "fused_add_rmsnorm")):
        try:
            return f"{module}.{attribute}", getattr(importlib.import_module(module), attribute)
        except Exception:  # noqa: BLE001 - missing, or broken on this GPU: try the next
            continue
    return "torch ops (sgl_kernel and flashinfer not importable)", _torch_add_rmsnorm


class BurstMeasurer:
    """Our candidates on this process's ranks (`lanes`): one size's CallBank at a time, and the checked CandidateRun
    that `time()` replays, so the checked graph is the timed one."""

    def __init__(self, spec, world: int, lanes: Sequence[int], device, backend):
        self.spec, self.world, self.lanes, self.device, self.backend = spec, int(world), list(lanes), device, backend
        self._bank: tuple[tuple, CallBank] | None = None  # (kind, dtype, rows), its bank
        self._run: tuple[tuple, CandidateRun] | None = None  # (route, kind, dtype, rows), its checked run

    def _bank_for(self, kind: str, dtype: str, rows: int) -> CallBank:
        if self._bank is None or self._bank[0] != (kind, dtype, rows):
            self._bank = None  # one size at a time (the Tuner measures a size's candidates together)
            self._bank = ((kind, dtype, rows), CallBank(kind, dtype, rows, int(self.spec.hidden), self.world,
                                                        self.lanes, self.device))
        return self._bank[1]

    def _verify_run(self, route: Route, kind: str, dtype: str, rows: int, workspaces: Mapping[int, Any],
                    check_timeouts: Callable[[], None]) -> str:
        self._run = None  # the last candidate's graph goes first
        run = CandidateRun(self._bank_for(kind, dtype, rows), route, workspaces, int(self.spec.calls), self.backend,
                           check_timeouts)
        digest = run.verify(int(self.spec.verify_calls), int(self.spec.burst_replays))
        self._run = ((route, kind, dtype, rows), run)  # only a checked run is ever timed
        return digest

    def _time_run(self, route: Route, kind: str, dtype: str, rows: int) -> list[float]:
        if self._run is None or self._run[0] != (route, kind, dtype, rows):
            raise RuntimeError(f"time({route_id(route)}) without its verify(): the checked graph is the timed one")
        try:
            return self._run[1].time(int(self.spec.iters), int(self.spec.warmup))
        finally:
            self._run = None


class CudaMeasurer(BurstMeasurer):
    def __init__(self, *, rank: int, world: int, device, cpu_group, nccl_group, spec, islands=None,
                 link: str | None = None, memory: str = "device"):
        device = torch.device(device)
        super().__init__(spec, world, [rank], device, CudaBackend(device, 1))
        self.rank, self.cpu_group, self.nccl_group = rank, cpu_group, nccl_group
        self.islands, self.link, self.memory = islands, link, memory
        self.norm_name, self.norm = find_fused_add_rmsnorm()
        self._ws = None
        self._workspace()  # collective: every rank builds it here

    def _workspace(self):
        if self._ws is None:
            from sgl_kernel_sm120 import IpcAllReduce

            self._ws = IpcAllReduce(  # bf16-sized: fp16's elements are as large
                self.cpu_group, self.device, int(self.spec.max_rows) * int(self.spec.hidden), torch.bfloat16,
                islands=self.islands, link=self.link or "auto", memory=self.memory,
                timeout_s=float(self.spec.kernel_timeout_s), on_timeout="exit")
        return self._ws

    def shape(self) -> WorkspaceShape:
        return self._workspace().shape

    def limits(self) -> KernelLimits:
        return self._workspace().limits

    def incumbent(self, kind: str) -> str:
        return "NCCL (torch.distributed.all_reduce)" if kind == "plain" else f"NCCL + {self.norm_name}"

    def reset(self) -> None:
        self._run = None
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close(collective=True, barrier_timeout_s=CLOSE_BARRIER_S)
            except Exception as exc:  # noqa: BLE001 - the next build is checked by its own joint checks
                logger.warning("sglang_sm120 tune rank %d: closing a workspace after a failure: %s", self.rank, exc)

    close = reset

    def _nccl(self, kind: str, dtype: str, rows: int):
        """NCCL's timed step: an all-reduce of zeros (the sum stays finite), then for the fused kind the incumbent
        add + RMSNorm."""
        bank = self._bank_for(kind, dtype, rows)
        buf, group, norm = bank.base[self.rank].clone().zero_(), self.nccl_group, self.norm
        residual = bank.inputs(0)["residual"] if kind == "fused" else None

        def step(k):
            dist.all_reduce(buf, group=group)
            if residual is not None:
                norm(buf, residual, bank.weight, bank.eps)

        return step

    def verify(self, route: Route, kind: str, dtype: str, rows: int) -> str:
        ws = self._workspace()  # its synchronize raises a timed-out wait's error (on_timeout="exit")
        return self._verify_run(route, kind, dtype, rows, {self.rank: ws}, ws.synchronize)

    def time(self, route: Route | None, kind: str, dtype: str, rows: int) -> list[float]:
        if route is not None:
            return self._time_run(route, kind, dtype, rows)
        calls = int(self.spec.calls)
        graph, _ = timing.capture_graph(self._nccl(kind, dtype, rows), calls)
        return [t / calls for t in timing.replay_times(graph, int(self.spec.iters), warmup=int(self.spec.warmup))]
