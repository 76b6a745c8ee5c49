"""The Measurer for a whole group in ONE process on one GPU (`python -m sglang_sm120.tune --one-process --tp W`):
the W ranks are IpcAllReduce.local_group workspaces (issue 17's concurrent mode), each rank's calls on a stream
of its own, timed as W parallel branches of one CUDA graph, so the ranks' kernels run at once and really wait
for one another, as on W GPUs, where ranks sharing a GPU as processes only time-slice.

A plumbing check for a one-GPU machine, like --share-gpu, and no more: a W-th of one GPU's SMs with every "link"
inside its memory is not a rank of a PCIe box, and NCCL cannot run a group inside one process, so the incumbent's
time must be injected (--debug-nccl-us) and the table says so. The Tuner runs once, as rank 0 of a world of one
(this process decides for the whole group); `verify` checks every rank's outputs exact and bit-identical across
the ranks itself. Nothing here is used by a server.

Eager calls are issued call-major, every rank's call k before any rank's call k + 1: with CUDA's lazy module
loading a rank-major order deadlocks until the kernels' timeout (IpcAllReduce.local_group).

Ran on no GPU yet (written 2026-12-02, after the session's device time ran out).
"""

from __future__ import annotations

from typing import Any

from ..routing.table import Route
from . import candidates as cand
from . import timing, verify
from .measure import workspace_shape


class LocalGroupMeasurer:
    def __init__(self, *, world: int, device, spec, islands=None, link: str | None = None, seed: int = 0):
        import torch

        if spec.debug_nccl_us is None:
            raise ValueError("a one-process group cannot run NCCL: its time must be injected (debug_nccl_us)")
        self.world, self.device, self.spec = int(world), torch.device(device), spec
        self.islands, self.link, self.seed = islands, link, seed
        self.offer = cand.detect_offer()
        self.max_numel = int(spec.max_rows) * int(spec.hidden)
        self._comms: list | None = None
        self._streams: list | None = None
        self._cases: dict[tuple[str, str, int], dict[str, Any]] = {}
        self._group()

    # -- the group -------------------------------------------------------------------------------------------
    def _group(self) -> list:
        if self._comms is None:
            import torch

            from sgl_kernel_sm120 import IpcAllReduce

            self._comms = IpcAllReduce.local_group(
                self.device, self.world, self.max_numel, torch.bfloat16, islands=self.islands,
                link=self.link or "auto", timeout_s=float(self.spec.kernel_timeout_s), on_timeout="exit",
            )
            self._streams = [torch.cuda.Stream(self.device) for _ in range(self.world)]
        return self._comms

    def shape(self) -> dict[str, Any]:
        return workspace_shape(self._group()[0], self.world)

    def incumbent(self, kind: str) -> str:
        return "NCCL, not run (one process; its time injected)"

    def reset(self) -> None:
        comms, self._comms = self._comms, None
        if comms is not None:
            from sgl_kernel_sm120.ipc_allreduce import close_local_group

            close_local_group(comms)

    close = reset

    # -- inputs: every rank's, on the one GPU ---------------------------------------------------------------
    def _case(self, kind: str, dtype: str, rows: int) -> dict[str, Any]:
        found = self._cases.get((kind, dtype, rows))
        if found is not None:
            return found
        import torch

        hidden, dev = int(self.spec.hidden), self.device
        if kind == "plain":
            inputs, expected = verify.plain_case(self.world, rows, hidden, dtype, self.seed)
            case = {"x": [x.to(dev) for x in inputs], "expected": (expected,),
                    "outs": [(torch.empty_like(expected, device=dev),) for _ in range(self.world)]}
        else:
            inputs, residual, weight, eps, norm, res = verify.fused_case(self.world, rows, hidden, dtype, self.seed)
            case = {"x": [x.to(dev) for x in inputs], "residual": residual.to(dev), "weight": weight.to(dev),
                    "eps": eps, "expected": (norm, res),
                    "outs": [(torch.empty_like(norm, device=dev), torch.empty_like(res, device=dev))
                             for _ in range(self.world)]}
        self._cases[(kind, dtype, rows)] = case
        return case

    def _calls(self, route: Route, kind: str, case: dict[str, Any]) -> list:
        """One callable per rank: that rank's call of `route`, into that rank's outputs."""
        if not route.ours:
            raise ValueError("NCCL cannot run in a one-process group (its time is injected)")
        comms = self._group()
        calls = []
        residual, weight, eps = case.get("residual"), case.get("weight"), case.get("eps")
        for r, ws in enumerate(comms):
            kwargs = cand.call_kwargs(route, self.offer)
            x, outs = case["x"][r], case["outs"][r]
            if kind == "plain":
                calls.append(lambda ws=ws, x=x, outs=outs, kw=kwargs: ws.all_reduce(x, outs[0], **kw))
            else:
                kwargs = cand.apply_cluster(ws, route, self.offer, kwargs)
                calls.append(lambda ws=ws, x=x, outs=outs, kw=kwargs: ws.all_reduce_add_rmsnorm(
                    x, residual, weight, eps, outs[0], outs[1], **kw))
        return calls

    def _launch_call_major(self, calls: list, times: int) -> None:
        import torch

        for _ in range(times):
            for r, call in enumerate(calls):
                with torch.cuda.stream(self._streams[r]):
                    call()

    def _raise_timeouts(self) -> None:
        for r, ws in enumerate(self._group()):
            err = ws.timeout_error()
            if err is not None:
                raise RuntimeError(f"rank {r}: {err}")

    # -- the Measurer interface ------------------------------------------------------------------------------
    def verify(self, route: Route, kind: str, dtype: str, rows: int) -> str:
        import torch

        case = self._case(kind, dtype, rows)
        calls = self._calls(route, kind, case)
        digests: list[str] = []
        for call in range(max(1, int(self.spec.verify_calls))):
            for outs in case["outs"]:
                for out in outs:
                    out.fill_(float("nan"))
            torch.cuda.synchronize(self.device)
            self._launch_call_major(calls, 1)
            torch.cuda.synchronize(self.device)
            self._raise_timeouts()
            names = ("norm", "residual") if kind == "fused" else ("sum",)
            digests = []
            for r, outs in enumerate(case["outs"]):
                for name, got, expected in zip(names, outs, case["expected"], strict=True):
                    problem = verify.mismatch(f"call {call + 1} rank {r} {name}", got, expected)
                    if problem:
                        raise AssertionError(problem)
                digests.append(verify.output_digest(*outs))
            if any(d != digests[0] for d in digests):
                raise AssertionError(f"call {call + 1}: the ranks' outputs differ in some bit")
        return digests[0]

    def time(self, route: Route, kind: str, dtype: str, rows: int) -> list[float]:
        import torch

        case = self._case(kind, dtype, rows)
        calls = self._calls(route, kind, case)
        per_graph = int(self.spec.calls)
        self._launch_call_major(calls, 1)  # eager warm-up, outside the capture
        torch.cuda.synchronize(self.device)
        main = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=main):
            for stream in self._streams:
                stream.wait_stream(main)
            for r, call in enumerate(calls):  # one branch per rank; a graph's kernels load at instantiation
                with torch.cuda.stream(self._streams[r]):
                    for _ in range(per_graph):
                        call()
            for stream in self._streams:
                main.wait_stream(stream)
        try:
            per_replay = timing.replay_times(graph, int(self.spec.iters), warmup=int(self.spec.warmup))
        finally:
            del graph
        torch.cuda.synchronize(self.device)
        self._raise_timeouts()  # a timed-out wait returns at once and would otherwise look fast
        return [t / per_graph for t in per_replay]


def run_one_process(world: int, device_index: int, spec, *, islands=None, link: str | None = None,
                    progress=None):
    """The whole tune in this process: (table, key). The key names the one GPU W times; the caller does not put
    such a table in the cache (a server's group never has this key's meaning)."""
    import torch

    from ..core.facts import key_facts
    from ..routing.table import make_key
    from .tuner import Tuner

    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    measurer = LocalGroupMeasurer(world=world, device=device, spec=spec, islands=islands, link=link)
    try:
        local = key_facts(device)
        key = make_key([local] * world, islands=islands, p2p=[[True] * world for _ in range(world)], memory="device")
        table = Tuner(measurer, spec, rank=0, world=1, gather=lambda obj: [obj], key=key,
                      progress=progress).run()
    finally:
        measurer.close()
    table.notes.append(f"one process: {world} ranks as workspaces of one GPU running concurrently "
                       "(IpcAllReduce.local_group), each on a W-th of its SMs; a plumbing check, not this box's "
                       "routes")
    return table, key
