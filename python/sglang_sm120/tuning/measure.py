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
from .burst import CudaBackend, Slots, Trial
from .verify import SizeBank, case_count

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
    """Our candidates on this process's ranks (`lanes`): one size's cases and call buffers at a time (shared by the
    size's candidates), and a Trial per candidate (tuning/burst.py)."""

    def __init__(self, spec, world: int, lanes: Sequence[int], device, backend):
        self.spec, self.world, self.lanes, self.device, self.backend = spec, int(world), list(lanes), device, backend
        self._slots: tuple[tuple, Slots] | None = None  # (kind, dtype, rows), its slots
        # this size's Trials by route id: a survivor's profile replays the graph its burst captured and checked
        self._trials: dict[str, Trial] = {}

    def forget_graphs(self) -> None:
        """Drop the kept Trials: their graphs launch on the workspace they were captured on (call before closing
        it)."""
        self._trials = {}

    def _slots_for(self, kind: str, dtype: str, rows: int) -> Slots:
        if self._slots is None or self._slots[0] != (kind, dtype, rows):
            self._slots = None  # one size at a time (the Tuner measures a size's candidates together)
            self.forget_graphs()
            calls = int(self.spec.calls)
            bank = SizeBank(kind, dtype, rows, int(self.spec.hidden), self.world, self.lanes, self.device,
                            case_count(calls))
            self._slots = ((kind, dtype, rows), Slots(bank, calls))
        return self._slots[1]

    def _run(self, route: Route, kind: str, dtype: str, rows: int, profile: bool,
             workspaces: Mapping[int, Any]) -> tuple[str, list[float]]:
        slots, rid, spec = self._slots_for(kind, dtype, rows), route_id(route), self.spec
        kept = self._trials.pop(rid, None) if profile else None
        trial = kept or Trial(slots, route, rid, workspaces, self.backend)
        if not profile:
            digest_and_times = trial.run(int(spec.burst))
            self._trials[rid] = trial  # kept only once it passed
            return digest_and_times
        # a kept graph passed its burst: one fed and checked replay before the profile's replays is enough
        return trial.run(1 if kept else int(spec.burst), int(spec.warmup), int(spec.iters))


class CudaMeasurer(BurstMeasurer):
    """One rank's measurer in its own process: `build()` makes the group's workspace (collective, the plan the
    server follows: core/plan.py), again after a failure; NCCL over `nccl_group`."""

    def __init__(self, *, rank: int, world: int, device, nccl_group, spec, build: Callable[[], Any],
                 workspace: Any = None):
        device = torch.device(device)
        super().__init__(spec, world, [rank], device, CudaBackend(device, 1))
        self.rank, self.nccl_group, self._build = rank, nccl_group, build
        self.norm_name, self.norm = find_fused_add_rmsnorm()
        self._ws = workspace

    def _workspace(self):
        if self._ws is None:
            self._ws = self._build()  # collective: the Tuner calls it on every rank at the same point
        return self._ws

    def shape(self) -> WorkspaceShape:
        return self._workspace().shape

    def limits(self) -> KernelLimits:
        return self._workspace().limits

    def incumbent(self, kind: str) -> str:
        return "NCCL (torch.distributed.all_reduce)" if kind == "plain" else f"NCCL + {self.norm_name}"

    def reset(self) -> None:
        self.forget_graphs()
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close(collective=True, barrier_timeout_s=CLOSE_BARRIER_S)
            except Exception as exc:  # noqa: BLE001 - the next build is checked by its own joint checks
                logger.warning("sglang_sm120 tune rank %d: closing a workspace after a failure: %s", self.rank, exc)

    close = reset

    def _nccl(self, kind: str, dtype: str, rows: int):
        """NCCL's timed step: an all-reduce of zeros, then for the fused kind the incumbent add + RMSNorm."""
        bank = self._slots_for(kind, dtype, rows).bank
        buf, group, norm = torch.zeros_like(bank.expected[0, 0]), self.nccl_group, self.norm
        residual = bank.residual[0].clone() if kind == "fused" else None

        def step(k):
            dist.all_reduce(buf, group=group)
            if residual is not None:
                norm(buf, residual, bank.weight, bank.eps)

        return step

    def trial(self, route: Route | None, kind: str, dtype: str, rows: int,
              profile: bool) -> tuple[str | None, list[float]]:
        """(digest of the checked outputs, us per call per timed replay); NCCL (route None): (None, its times)."""
        if route is not None:
            return self._run(route, kind, dtype, rows, profile, {self.rank: self._workspace()})
        calls = int(self.spec.calls)
        graph, _ = timing.capture_graph(self._nccl(kind, dtype, rows), calls)
        times = timing.replay_times(graph, int(self.spec.iters), warmup=int(self.spec.warmup))
        return None, [t / calls for t in times]
