"""The tune of a whole group in ONE process on one GPU (`python -m benchmarks.harness.local_tune --tp W
--debug-nccl-us US --out FILE`; benchmarks/bench_tune.py, bench_tuner_pick and tests/gpu/test_tune_gpu.py use it):
the W ranks are local_group.local_group workspaces, each rank's calls on a stream of its own, replayed as W parallel
branches of one CUDA graph, so the ranks' kernels run at once and really wait for one another, as on W GPUs, where
ranks sharing a GPU as processes only time-slice.

A plumbing check for a one-GPU machine, like --share-gpu, and no more: a W-th of one GPU's SMs with every "link"
inside its memory is not a rank of a PCIe box, and NCCL cannot run a group inside one process, so the incumbent's
time must be injected (--debug-nccl-us) and the table says so. The Tuner runs once, as rank 0 of a world of one
(this process decides for the whole group); a Trial checks every rank's outputs exact and bit-identical across the
ranks itself. A server never uses it. Like a tune's rank process it runs the cluster check itself first.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sgl_kernel_sm120.policy import KernelLimits, Route, WorkspaceShape
from sglang_sm120.tuning.burst import CudaBackend
from sglang_sm120.tuning.measure import BurstMeasurer


def _cuda_group(device, world: int, max_numel: int, spec, islands, link):
    import torch

    from benchmarks.harness.local_group import local_group

    return local_group(device, world, max_numel, torch.bfloat16, islands=islands, link=link or "auto",
                       timeout_s=float(spec.kernel_timeout_s), on_timeout="exit")


def _close_cuda_group(comms) -> None:
    from benchmarks.harness.local_group import close_local_group

    close_local_group(comms)


class LocalGroupMeasurer(BurstMeasurer):
    """`make_group(device, world, max_numel, spec, islands, link)` / `close_group(comms)` / `backend` default to
    local_group.local_group on CUDA; the CPU tests pass fakes."""

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
        self.forget_graphs()
        comms, self._comms = self._comms, None
        if comms is not None:
            self._close_group(comms)

    def close(self) -> None:
        self.reset()
        self._slots = None

    def trial(self, route: Route | None, kind: str, dtype: str, rows: int,
              profile: bool) -> tuple[str | None, list[float]]:
        if route is None:
            raise ValueError("NCCL cannot run in a one-process group (its time is injected)")
        return self._run(route, kind, dtype, rows, profile, dict(enumerate(self._group())))


def run_one_process(world: int, device_index: int, spec, *, islands=None, link: str | None = None,
                    progress=None):
    """The whole tune in this process: (table, key). The key names the one GPU W times; the caller does not put
    such a table in the cache (a server's group never has this key's meaning). The table's durations hold the
    start-up phases of this process and the measuring."""
    phases, mark = {}, time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name], mark = round(now - mark, 3), now

    import torch

    from sgl_kernel_sm120 import _ext, cluster_check
    from sgl_kernel_sm120.settings import read
    from sglang_sm120.core.facts import key_facts
    from sglang_sm120.routing.table import make_key
    from sglang_sm120.tuning.tuner import Tuner

    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    torch.zeros(1, device=device)
    phase("torch and CUDA")
    verdict = cluster_check.check_here(device_index, str(torch.cuda.get_device_properties(device_index).uuid),
                                       _ext.library_path(), read())
    if verdict.context_lost:
        raise RuntimeError(f"the cluster check broke this process's CUDA context: {verdict.reason}")
    phase("cluster check")
    measurer = LocalGroupMeasurer(world=world, device=device, spec=spec, islands=islands, link=link)
    try:
        measurer.shape()
        phase("workspace")
        local = key_facts(device)
        key = make_key([local] * world, islands=islands, p2p=[[True] * world for _ in range(world)], memory="device")
        table = Tuner(measurer, spec, rank=0, world=1, gather=lambda obj: [obj], key=key,
                      progress=progress).run()
    finally:
        measurer.close()
    table.durations.update(phases)
    table.notes.append(f"one process: {world} ranks as workspaces of one GPU running concurrently "
                       "(local_group.local_group), each on a W-th of its SMs; a plumbing check, not this box's routes")
    return table, key


def progress_printer(spec, start: float) -> Callable[[dict], None]:
    """Prints a line, flushed, at each new size of the tune: a run cut off by its caller still says how far it got."""
    kinds, rows, seen = list(spec.kinds), list(spec.rows), set()

    def printer(event: dict) -> None:
        where = (event["dtype"], event["kind"], event["rows"])
        if where in seen:
            return
        seen.add(where)
        at = rows.index(event["rows"]) + 1 if event["rows"] in rows else "?"
        print(f"[{time.monotonic() - start:.1f} s] {event['dtype']} {event['kind']} (kind "
              f"{kinds.index(event['kind']) + 1} of {len(kinds)}): {event['rows']} rows, size {at} of {len(rows)}",
              flush=True)
    return printer


def main(argv=None) -> int:
    start = time.monotonic()
    import argparse

    from sglang_sm120.routing import cache, render
    from sglang_sm120.tuning.tuner import TuneSpec, graph_rows

    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.local_tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, required=True, help="ranks, all on one GPU (2, 4 or 8)")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--max-rows", type=int, default=4, help="rows to measure up to")
    parser.add_argument("--cuda-graph-bs", default="", help="comma list of captured batch sizes (each measured)")
    parser.add_argument("--draft-tokens", type=int, default=1, help="draft tokens per request")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    parser.add_argument("--kinds", default="plain,fused", help="comma list of plain, fused")
    parser.add_argument("--full", action="store_true", help="the full tune, not the quick one")
    parser.add_argument("--device", type=int, default=0, help="the GPU")
    parser.add_argument("--debug-nccl-us", type=float, required=True,
                        help="NCCL's time, injected: NCCL cannot run a group inside one process")
    parser.add_argument("--out", required=True, help="the table's file (never the cache)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.cuda_graph_bs.split(",") if b.strip()]
    rows = graph_rows(batches, args.draft_tokens) if batches else []
    spec = TuneSpec.make(args.hidden, args.max_rows, quick=not args.full, dtypes=[args.dtype],
                         kinds=[k.strip() for k in args.kinds.split(",") if k.strip()], kernel_timeout_s=5.0,
                         debug_nccl_us=args.debug_nccl_us, graph_rows=[r for r in rows if r <= args.max_rows])
    table, _ = run_one_process(args.tp, args.device, spec, progress=progress_printer(spec, start))
    table.durations["total"] = round(time.monotonic() - start, 3)
    cache.save(table, path=args.out)
    print(render.table_markdown(table, path=args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
