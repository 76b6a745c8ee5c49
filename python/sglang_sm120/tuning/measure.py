"""The CUDA side of a tune, for one rank: the workspace the candidates run on, their inputs, one call of each
candidate, and its verification and timing (the `Measurer` interface of tuning/tuner.py).

Ran on 1x H200 (ranks sharing it), 2026-12-02, before the checked graph burst (tuning/burst.py), the launch
shapes and the routes as data existed; those have not run on a GPU yet. A candidate is a
sgl_kernel_sm120.policy.Route, which IpcAllReduce.launch / launch_fused run as given, after one check of the
call's arguments (`refusal`) when the run is set up.

Choices:
- one workspace (bf16-sized; fp16 has the same element size), built with on_timeout="exit" and a short wait
  bound, so a candidate that hangs on this fabric fails in seconds and leaves the CUDA context usable; after any
  failure the Tuner calls `reset()` on every rank and the next candidate builds a fresh workspace;
- a candidate of ours is checked and timed by tuning/burst.py with this rank as its one lane: eager calls, a
  burst of graph replays with inputs of their own per call (tuning/calls.py), then the same graph timed and its
  outputs checked again; the workspace's timeout record is read after each step: a kernel that timed out
  returns at once and would otherwise look fast;
- NCCL is timed on a zero-filled buffer (its sum stays finite), followed for the fused kind by the incumbent
  add + RMSNorm (tuning/incumbent.py) on a residual of the verify case.
"""

from __future__ import annotations

import logging

from sgl_kernel_sm120.policy import KernelLimits, Route, WorkspaceShape

from ..routing.table import route_id
from . import timing
from .burst import CandidateRun, CudaBackend
from .calls import CallBank
from .incumbent import find_fused_add_rmsnorm

logger = logging.getLogger("sglang_sm120")

CLOSE_BARRIER_S = 30.0


def checked_calls(ws, route: Route, kind: str, weight, eps):
    """`make_call` of a CandidateRun on workspace `ws`: each call's arguments are checked once, when the run is set
    up (the check raises on a route or tensor the workspace cannot run), and the calls launch without a check."""
    fused = kind == "fused"

    def make(rank: int, x, residual, outs):
        why = ws.refusal(x, route, fused=fused, residual=residual, weight=weight, outs=outs)
        if why:
            raise ValueError(f"{route.id} cannot run here: {why}")
        if not fused:
            return lambda: ws.launch(route, x, outs[0])
        return lambda: ws.launch_fused(route, x, residual, weight, eps, outs[0], outs[1])

    return make


class CudaMeasurer:
    def __init__(self, *, rank: int, world: int, device, cpu_group, nccl_group, spec, islands=None,
                 link: str | None = None, memory: str = "device", seed: int = 0):
        import torch

        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.cpu_group, self.nccl_group, self.spec = cpu_group, nccl_group, spec
        self.islands, self.link, self.memory, self.seed = islands, link, memory, seed
        self.norm_name, self.norm = find_fused_add_rmsnorm()
        self.max_numel = int(spec.max_rows) * int(spec.hidden)
        self._ws = None
        self.backend = CudaBackend(self.device, 1)
        self._bank: tuple[tuple[str, str, int], CallBank] | None = None
        self._nccl_case: tuple | None = None
        self._run: tuple[tuple, CandidateRun] | None = None
        self._workspace()  # collective: every rank builds it here

    # -- the workspace -------------------------------------------------------------------------------------
    def _workspace(self):
        if self._ws is None:
            import torch

            from sgl_kernel_sm120 import IpcAllReduce

            self._ws = IpcAllReduce(
                self.cpu_group, self.device, self.max_numel, torch.bfloat16, islands=self.islands,
                link=self.link or "auto", memory=self.memory, timeout_s=float(self.spec.kernel_timeout_s),
                on_timeout="exit",
            )
        return self._ws

    def shape(self) -> WorkspaceShape:
        return self._workspace().shape

    def limits(self) -> KernelLimits:
        return self._workspace().limits

    def incumbent(self, kind: str) -> str:
        return "NCCL (torch.distributed.all_reduce)" if kind == "plain" else f"NCCL + {self.norm_name}"

    def reset(self) -> None:
        self._drop_run()
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close(collective=True, barrier_timeout_s=CLOSE_BARRIER_S)
            except Exception as exc:  # noqa: BLE001 - the next build is checked by its own joint checks
                logger.warning("sglang_sm120 tune rank %d: closing a workspace after a failure: %s", self.rank, exc)

    close = reset

    # -- inputs ----------------------------------------------------------------------------------------------
    def _bank_for(self, kind: str, dtype: str, rows: int) -> CallBank:
        where = (kind, dtype, rows)
        if self._bank is None or self._bank[0] != where:
            self._bank, self._nccl_case = None, None  # one size at a time: its candidates are measured together
            self._bank = (where, CallBank(kind, dtype, rows, int(self.spec.hidden), self.world, [self.rank],
                                          self.device, self.seed))
        return self._bank[1]

    def _nccl(self, kind: str, dtype: str, rows: int):
        """NCCL's timed step: an all-reduce of zeros (the sum stays finite), then for the fused kind the
        incumbent add + RMSNorm."""
        import torch.distributed as dist

        bank = self._bank_for(kind, dtype, rows)
        if self._nccl_case is None:
            zeros = bank.base[self.rank].clone().zero_()
            residual = bank.inputs(0)["residual"] if kind == "fused" else zeros.clone()
            self._nccl_case = (zeros, residual)
        buf, residual = self._nccl_case
        group, weight, eps, norm = self.nccl_group, getattr(bank, "weight", None), bank.eps, self.norm
        if kind == "plain":
            return lambda k: dist.all_reduce(buf, group=group)

        def nccl_then_norm(k):
            dist.all_reduce(buf, group=group)
            norm(buf, residual, weight, eps)

        return nccl_then_norm

    def _drop_run(self) -> None:
        if self._run is not None:
            self._run[1].close()
        self._run = None

    # -- the Measurer interface ------------------------------------------------------------------------------
    def verify(self, route: Route | None, kind: str, dtype: str, rows: int) -> str:
        self._drop_run()
        bank = self._bank_for(kind, dtype, rows)
        ws = self._workspace()
        make = checked_calls(ws, route, kind, getattr(bank, "weight", None), bank.eps)
        run = CandidateRun(bank, route_id(route), [self.rank], int(self.spec.calls), make, self.backend,
                           ws.synchronize)  # synchronize raises a timed-out wait's error (exit mode)
        self._run = ((route, kind, dtype, rows), run)
        return run.verify(int(self.spec.verify_calls), int(self.spec.burst_replays))

    def time(self, route: Route | None, kind: str, dtype: str, rows: int) -> list[float]:
        import torch

        if route is not None:
            if self._run is None or self._run[0] != (route, kind, dtype, rows):
                raise RuntimeError(f"time({route_id(route)}) without its verify(): the checked graph is the timed one")
            try:
                return self._run[1].time(int(self.spec.iters), int(self.spec.warmup))
            finally:
                self._drop_run()
        calls = int(self.spec.calls)
        graph, _ = timing.capture_graph(self._nccl(kind, dtype, rows), calls, eager_warmup=1)
        try:
            per_replay = timing.replay_times(graph, int(self.spec.iters), warmup=int(self.spec.warmup))
        finally:
            del graph
        torch.cuda.synchronize(self.device)
        return [t / calls for t in per_replay]
