"""The CUDA side of a tune, for one rank: the workspace the candidates run on, their inputs, one call of each
candidate, and its verification and timing (the `Measurer` interface of tuning/tuner.py).

Ran on 1x H200 (ranks sharing it), 2026-12-02, before the checked graph burst (tuning/burst.py) and the launch
shapes (`blocks=`, `cluster=` per call) existed; those have not run on a GPU yet. Written against
sgl_kernel_sm120.IpcAllReduce (per-call `variant=`, `transport=`, `blocks=`, `cluster=`), whose offer it
detects (tuning/candidates.py) and uses only where present.

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
from typing import Any

from ..routing.table import Route
from . import candidates as cand
from . import timing
from .burst import CandidateRun, CudaBackend
from .calls import CallBank
from .incumbent import find_fused_add_rmsnorm

logger = logging.getLogger("sglang_sm120")

CLOSE_BARRIER_S = 30.0


def workspace_shape(ws, world: int) -> dict[str, Any]:
    """A Measurer's `shape()`: the GroupShape fields as a built workspace of a `world`-rank group sees them."""
    return {
        "world_size": int(world),
        "memory": ws.memory,
        "num_islands": int(ws.num_islands),
        "oneshot_max_bytes": int(ws.oneshot_max_numel) * 2,
        "clusters": sorted(int(c) for c in ws.fused_clusters.get("clusters", [])),
        "sm_budget": int(getattr(ws, "sm_budget", 0) or 0),
        "staged_ctas": _staged_ctas(),
    }


def _staged_ctas() -> int:
    from sgl_kernel_sm120.variants import STAGED_MAX_CTAS

    return int(STAGED_MAX_CTAS)


class CudaMeasurer:
    def __init__(self, *, rank: int, world: int, device, cpu_group, nccl_group, spec, islands=None,
                 link: str | None = None, memory: str = "device", seed: int = 0):
        import torch

        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.cpu_group, self.nccl_group, self.spec = cpu_group, nccl_group, spec
        self.islands, self.link, self.memory, self.seed = islands, link, memory, seed
        self.offer = cand.detect_offer()
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

            extra = {"transport": "auto"} if self.offer.ctor_transport else {}
            self._ws = IpcAllReduce(
                self.cpu_group, self.device, self.max_numel, torch.bfloat16, islands=self.islands,
                link=self.link or "auto", memory=self.memory, timeout_s=float(self.spec.kernel_timeout_s),
                on_timeout="exit", **extra,
            )
        return self._ws

    def shape(self) -> dict[str, Any]:
        return workspace_shape(self._workspace(), self.world)

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

    def _make_call(self, route: Route, kind: str, bank: CallBank):
        ws = self._workspace()
        kwargs = cand.call_kwargs(route, self.offer)
        if kind == "fused":
            kwargs = cand.apply_cluster(ws, route, self.offer, kwargs)

        def make(rank: int, x, residual, outs):
            if kind == "plain":
                return lambda: ws.all_reduce(x, outs[0], **kwargs)
            return lambda: ws.all_reduce_add_rmsnorm(x, residual, bank.weight, bank.eps, outs[0], outs[1], **kwargs)

        return make

    def _drop_run(self) -> None:
        if self._run is not None:
            self._run[1].close()
        self._run = None

    # -- the Measurer interface ------------------------------------------------------------------------------
    def verify(self, route: Route, kind: str, dtype: str, rows: int) -> str:
        self._drop_run()
        bank = self._bank_for(kind, dtype, rows)
        ws = self._workspace()
        run = CandidateRun(bank, route.id, [self.rank], int(self.spec.calls), self._make_call(route, kind, bank),
                           self.backend, ws.synchronize)  # synchronize raises a timed-out wait's error (exit mode)
        self._run = ((route, kind, dtype, rows), run)
        return run.verify(int(self.spec.verify_calls), int(self.spec.burst_replays))

    def time(self, route: Route, kind: str, dtype: str, rows: int) -> list[float]:
        import torch

        if route.ours:
            if self._run is None or self._run[0] != (route, kind, dtype, rows):
                raise RuntimeError(f"time({route.id}) without its verify(): the checked graph is the timed one")
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
