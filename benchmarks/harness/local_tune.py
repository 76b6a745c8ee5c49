"""The tune of a whole group in ONE process on one GPU (`python -m benchmarks.harness.local_tune --tp W
--debug-nccl-us US --out FILE`; tests/gpu/test_tune_gpu.py and bench_tuner_pick use it):
the W ranks are _debug.local_group workspaces (its concurrent mode), each rank's calls on a stream
of its own, timed as W parallel branches of one CUDA graph, so the ranks' kernels run at once and really wait
for one another, as on W GPUs, where ranks sharing a GPU as processes only time-slice.

A plumbing check for a one-GPU machine, like --share-gpu, and no more: a W-th of one GPU's SMs with every "link"
inside its memory is not a rank of a PCIe box, and NCCL cannot run a group inside one process, so the incumbent's
time must be injected (--debug-nccl-us) and the table says so. The Tuner runs once, as rank 0 of a world of one
(this process decides for the whole group); `verify` checks every rank's outputs exact and bit-identical across
the ranks itself. A server never uses it. The check and the timing of a candidate are those of
tuning/burst.py, with every rank a lane: eager calls call-major (every rank's call k before any rank's call
k + 1: with CUDA's lazy module loading a rank-major order deadlocks until the kernels' timeout,
_debug.local_group), graph replays with one branch per rank.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_kernel_sm120.policy import KernelLimits, Route, WorkspaceShape
from sglang_sm120.tuning.burst import CudaBackend
from sglang_sm120.tuning.measure import BurstMeasurer


def _cuda_group(device, world: int, max_numel: int, spec, islands, link):
    import torch

    from sgl_kernel_sm120._debug import local_group

    return local_group(device, world, max_numel, torch.bfloat16, islands=islands, link=link or "auto",
                                    timeout_s=float(spec.kernel_timeout_s), on_timeout="exit")


def _close_cuda_group(comms) -> None:
    from sgl_kernel_sm120._debug import close_local_group

    close_local_group(comms)


class LocalGroupMeasurer(BurstMeasurer):
    """`make_group(device, world, max_numel, spec, islands, link)` / `close_group(comms)` / `backend` default to
    _debug.local_group on CUDA; the CPU tests pass fakes."""

    def __init__(self, *, world: int, device, spec, islands=None, link: str | None = None,
                 make_group: Callable | None = None, close_group: Callable | None = None, backend=None):
        import torch

        if spec.debug_nccl_us is None:
            raise ValueError("a one-process group cannot run NCCL: its time must be injected (debug_nccl_us)")
        device, world = torch.device(device), int(world)
        super().__init__(spec, world, range(world), device,
                         backend if backend is not None else CudaBackend(device, world))
        self.islands, self.link = islands, link
        self.max_numel = int(spec.max_rows) * int(spec.hidden)
        self._make_group, self._close_group = make_group or _cuda_group, close_group or _close_cuda_group
        self._comms: list | None = None
        self._group()

    # -- the group -------------------------------------------------------------------------------------------
    def _group(self) -> list:
        if self._comms is None:
            self._comms = self._make_group(self.device, self.world, self.max_numel, self.spec, self.islands,
                                           self.link)
        return self._comms

    def shape(self) -> WorkspaceShape:
        return self._group()[0].shape

    def limits(self) -> KernelLimits:
        return self._group()[0].limits

    def incumbent(self, kind: str) -> str:
        return "NCCL, not run (one process; its time injected)"

    def reset(self) -> None:
        self._run = None
        comms, self._comms = self._comms, None
        if comms is not None:
            self._close_group(comms)

    def close(self) -> None:
        self.reset()
        self._bank = None

    def _raise_timeouts(self) -> None:
        for r, ws in enumerate(self._group()):
            err = ws.timeout_error()
            if err is not None:
                raise RuntimeError(f"rank {r}: {err}")

    # -- the Measurer interface ------------------------------------------------------------------------------
    def verify(self, route: Route | None, kind: str, dtype: str, rows: int) -> str:
        if route is None:
            raise ValueError("NCCL cannot run in a one-process group (its time is injected)")
        return self._verify_run(route, kind, dtype, rows, dict(enumerate(self._group())), self._raise_timeouts)

    def time(self, route: Route | None, kind: str, dtype: str, rows: int) -> list[float]:
        return self._time_run(route, kind, dtype, rows)


def run_one_process(world: int, device_index: int, spec, *, islands=None, link: str | None = None,
                    progress=None):
    """The whole tune in this process: (table, key). The key names the one GPU W times; the caller does not put
    such a table in the cache (a server's group never has this key's meaning)."""
    import torch

    from sglang_sm120.core.facts import key_facts
    from sglang_sm120.routing.table import make_key
    from sglang_sm120.tuning.tuner import Tuner

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
                       "(_debug.local_group), each on a W-th of its SMs; a plumbing check, not this box's "
                       "routes")
    return table, key


def main(argv=None) -> int:
    import argparse
    import time

    from sglang_sm120.routing import cache, render
    from sglang_sm120.tuning.tuner import TuneSpec

    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.local_tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, required=True, help="ranks, all on one GPU (2, 4 or 8)")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--max-rows", type=int, default=4, help="rows to measure up to")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    parser.add_argument("--device", type=int, default=0, help="the GPU")
    parser.add_argument("--debug-nccl-us", type=float, required=True,
                        help="NCCL's time, injected: NCCL cannot run a group inside one process")
    parser.add_argument("--out", required=True, help="the table's file (never the cache)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    spec = TuneSpec.make(args.hidden, args.max_rows, quick=True, dtypes=[args.dtype], kernel_timeout_s=5.0,
                         debug_nccl_us=args.debug_nccl_us)
    table, _ = run_one_process(args.tp, args.device, spec)
    table.durations["total"] = round(time.monotonic() - start, 3)
    cache.save(table, path=args.out)
    print(render.table_markdown(table, path=args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
