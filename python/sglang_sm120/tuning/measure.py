"""The CUDA side of a tune, for one rank: the workspace the candidates run on, their inputs, one call of each
candidate, and its verification and timing (the `Measurer` interface of tuning/tuner.py).

Ran on 1x H200 (ranks sharing it), 2026-12-02. Written against sgl_kernel_sm120.IpcAllReduce as it is (push
transport, per-call
`variant=`, the workspace attribute `fused_cluster`) and against the interface issue 17 adds (`transport=` on
the constructor and the calls, `cluster=` on the fused call), which it detects (tuning/candidates.py) and uses
only where present.

Choices:
- one workspace (bf16-sized; fp16 has the same element size), built with on_timeout="exit" and a short wait
  bound, so a candidate that hangs on this fabric fails in seconds and leaves the CUDA context usable; after any
  failure the Tuner calls `reset()` on every rank and the next candidate builds a fresh workspace;
- verification runs `spec.verify_calls` eager calls (both halves of the double buffer), each into outputs
  filled with NaN first, so a call that writes nothing cannot pass;
- timing captures `spec.calls` calls into one CUDA graph (eager warm-up first: NCCL's communicator and our
  workspace's lazy state are set up outside the capture), replays it, and reads the workspace's timeout record
  afterwards: a kernel that timed out inside a replay returns at once and would otherwise look fast;
- NCCL is timed on a zero-filled buffer (its sum stays finite), followed for the fused kind by the incumbent
  add + RMSNorm (tuning/incumbent.py) on a residual of the verify case.
"""

from __future__ import annotations

import logging
from typing import Any

from ..routing.table import Route
from . import candidates as cand
from . import timing, verify
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
    }


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
        self._cases: dict[tuple[str, str, int], dict[str, Any]] = {}
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
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                ws.close(collective=True, barrier_timeout_s=CLOSE_BARRIER_S)
            except Exception as exc:  # noqa: BLE001 - the next build is checked by its own joint checks
                logger.warning("sglang_sm120 tune rank %d: closing a workspace after a failure: %s", self.rank, exc)

    close = reset

    # -- inputs ----------------------------------------------------------------------------------------------
    def _case(self, kind: str, dtype: str, rows: int) -> dict[str, Any]:
        found = self._cases.get((kind, dtype, rows))
        if found is not None:
            return found
        import torch

        hidden, dev = int(self.spec.hidden), self.device
        if kind == "plain":
            inputs, expected = verify.plain_case(self.world, rows, hidden, dtype, self.seed)
            case = {"x": inputs[self.rank].to(dev), "out": torch.empty_like(inputs[0], device=dev),
                    "expected": (expected,)}
        else:
            inputs, residual, weight, eps, norm, res = verify.fused_case(self.world, rows, hidden, dtype, self.seed)
            case = {"x": inputs[self.rank].to(dev), "residual": residual.to(dev), "weight": weight.to(dev),
                    "eps": eps, "norm_out": torch.empty_like(norm, device=dev),
                    "res_out": torch.empty_like(res, device=dev), "expected": (norm, res)}
        case["zeros"] = torch.zeros_like(case["x"])
        case["nccl_residual"] = (case["residual"] if kind == "fused" else case["x"]).clone()
        case["nccl_weight"] = case.get("weight")
        self._cases[(kind, dtype, rows)] = case
        return case

    # -- one call --------------------------------------------------------------------------------------------
    def _step(self, route: Route, kind: str, case: dict[str, Any]):
        if not route.ours:
            import torch.distributed as dist

            buf, group = case["zeros"], self.nccl_group
            if kind == "plain":
                return lambda k: dist.all_reduce(buf, group=group)
            residual, weight, eps, norm = case["nccl_residual"], case["nccl_weight"], case["eps"], self.norm

            def nccl_then_norm(k):
                dist.all_reduce(buf, group=group)
                norm(buf, residual, weight, eps)

            return nccl_then_norm
        ws = self._workspace()
        kwargs = cand.call_kwargs(route, self.offer)
        if kind == "plain":
            x, out = case["x"], case["out"]
            return lambda k: ws.all_reduce(x, out, **kwargs)
        kwargs = cand.apply_cluster(ws, route, self.offer, kwargs)
        x, residual, weight, eps = case["x"], case["residual"], case["weight"], case["eps"]
        norm_out, res_out = case["norm_out"], case["res_out"]
        return lambda k: ws.all_reduce_add_rmsnorm(x, residual, weight, eps, norm_out, res_out, **kwargs)

    def _outputs(self, kind: str, case: dict[str, Any]) -> tuple:
        return (case["out"],) if kind == "plain" else (case["norm_out"], case["res_out"])

    # -- the Measurer interface ------------------------------------------------------------------------------
    def verify(self, route: Route, kind: str, dtype: str, rows: int) -> str:
        case = self._case(kind, dtype, rows)
        step = self._step(route, kind, case)
        ws = self._workspace()
        digest = ""
        for call in range(max(1, int(self.spec.verify_calls))):
            for out in self._outputs(kind, case):
                out.fill_(float("nan"))
            step(call)
            ws.synchronize()  # raises IpcAllReduceTimeoutError when a wait timed out (exit mode)
            outputs = self._outputs(kind, case)
            for name, got, expected in zip(("norm" if kind == "fused" else "sum", "residual"), outputs,
                                           case["expected"], strict=False):
                problem = verify.mismatch(f"call {call + 1} {name}", got, expected)
                if problem:
                    raise AssertionError(problem)
            digest = verify.output_digest(*outputs)
        return digest

    def time(self, route: Route, kind: str, dtype: str, rows: int) -> list[float]:
        import torch

        case = self._case(kind, dtype, rows)
        step = self._step(route, kind, case)
        calls = int(self.spec.calls)
        graph, _ = timing.capture_graph(step, calls, eager_warmup=1)
        try:
            per_replay = timing.replay_times(graph, int(self.spec.iters), warmup=int(self.spec.warmup))
        finally:
            del graph
        if route.ours:
            self._workspace().synchronize()  # a timed-out wait inside a replay fails the candidate here
        else:
            torch.cuda.synchronize(self.device)
        return [t / calls for t in per_replay]
