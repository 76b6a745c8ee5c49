"""One rank of a tune as its own process (started by tuning/processes.py), so that a candidate that kills its CUDA
context kills this process only. It dies with its parent (a parent-death signal, and a watch on its parent's pid,
however the parent ends), checks its GPU's cluster launch (cluster_check.py: this process may die, a server's rank
must not), joins the other ranks on 127.0.0.1:PORT (NCCL for the incumbent, gloo for every agreement), builds the
workspace a server would build (core/plan.py, the data-path probe's fallback to host memory included), computes
the table key as a server's ranks do and runs the Tuner without the candidates blamed under that key. It reports one
JSON object a line after MARKER: a phase event as each start-up phase ends ("cuda", "clusters", "group",
"workspace"), "setup" with the key, "begin" before every candidate, then "done" (the table) or "error".
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback

MARKER = "@@sm120-tune "
INIT_TIMEOUT_S = 300.0
PARENT_POLL_S = 0.5
RETRY_EXIT_CODE = 3  # the cluster check broke this process's CUDA context: its verdict is cached, start again
PR_SET_PDEATHSIG = 1


def emit(event: dict) -> None:
    print(MARKER + json.dumps(event, sort_keys=True), flush=True)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent ends (Linux), and a watch for the case the signal missed: a parent that ended before
    the signal was armed, or a platform without it. Children run in sessions of their own, so nothing else reaches
    them when a launcher kills the tool."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="sm120-tune-parent-watch", daemon=True).start()


def _construct(gather, device, spec, chosen):
    """One collective construction of `chosen` (core/plan.build's step): (workspace or None, failures by rank)."""
    import torch

    from sgl_kernel_sm120 import IpcAllReduce

    from ..core.plan import failure_of

    workspace, outcome = None, {"error": None}
    try:
        workspace = IpcAllReduce(  # bf16-sized: fp16's elements are as large
            gather.group, device, int(spec.max_rows) * int(spec.hidden), torch.bfloat16, islands=chosen.islands,
            link=chosen.link, memory=chosen.memory, timeout_s=float(spec.kernel_timeout_s), on_timeout="exit")
    except Exception as exc:  # the construction raises on every rank together; agreed below
        outcome = failure_of(exc)
    failed = {r: o for r, o in enumerate(gather(outcome)) if o.get("error")}
    if failed and workspace is not None:
        with contextlib.suppress(Exception):
            workspace.close(collective=False)
        workspace = None
    return workspace, failed


class _Gather:
    """All-gather of a JSON value over the group's gloo group."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world

    def __call__(self, obj):
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def run(rank: int, world: int, device_index: int, port: int, spec_path: str) -> int:
    import torch

    from sgl_kernel_sm120 import _ext, cluster_check
    from sgl_kernel_sm120.settings import read

    from ..core import config, plan
    from ..core.facts import group_facts, key_facts, launch_facts, p2p_row
    from ..core.topology import probe
    from ..routing import cache
    from ..routing.table import make_key
    from .measure import CudaMeasurer
    from .tuner import Tuner, TuneSpec

    with open(spec_path, encoding="utf-8") as handle:
        spec = TuneSpec(**json.load(handle))
    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    torch.zeros(1, device=device)  # the CUDA context, now
    emit({"event": "cuda"})
    props = torch.cuda.get_device_properties(device_index)
    verdict = cluster_check.check_here(device_index, str(props.uuid), _ext.library_path(), read())
    emit({"event": "clusters", "ok": verdict.ok, "reason": verdict.reason, "source": verdict.source})
    if verdict.context_lost:
        emit({"event": "error", "retry": True, "error": f"the cluster check broke this process's CUDA context "
                                                         f"({verdict.reason}); no clusters on this GPU (cached)"})
        return RETRY_EXIT_CODE

    import torch.distributed as dist

    # A debug run that injects NCCL's time (ranks sharing one GPU, where NCCL refuses to start) runs on gloo alone.
    backend = "gloo" if spec.debug_nccl_us is not None else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    measurer = None
    try:
        gather = _Gather(dist.new_group(backend="gloo"), world)
        if backend == "nccl":
            dist.all_reduce(torch.zeros(1, device=device))  # NCCL's communicator, now
        emit({"event": "group"})
        everyone = gather({"key": key_facts(device), "p2p": p2p_row(device_index)})
        p2p = group_facts([{"uuid": e["key"]["uuid"], "p2p": e["p2p"], "capability": [0, 0]} for e in everyone]).p2p
        hostmem = config.settings_from_environment().hostmem
        topology = probe([e["key"]["uuid"] for e in everyone]) if p2p and all(all(row) for row in p2p) else None
        built = plan.build(plan.plan(p2p, hostmem, topology), lambda chosen: _construct(gather, device, spec, chosen),
                           hostmem)
        if built.workspace is None:
            raise RuntimeError(built.failure)
        workspace = built.workspace
        emit({"event": "workspace", "memory": workspace.shape.memory.value, "note": built.note})
        key = make_key([e["key"] for e in everyone], islands=workspace.islands, p2p=p2p,
                       memory=workspace.shape.memory.value, launch=launch_facts(workspace))
        emit({"event": "setup", "key": key, "memory_note": built.note})
        # Every rank's read of the blamed candidates, so that every rank excludes the same.
        for entry in [entry for blamed in gather(cache.blames(key)) for entry in blamed]:
            rule = {field: entry[field] for field in ("dtype", "kind", "candidate", "from_bytes")}
            if not any({f: r.get(f) for f in rule} == rule for r in spec.exclude):
                spec.exclude.append({**rule, "reason": f"blamed before: {entry.get('reason')}"})

        def build_again():
            again, failed = _construct(gather, device, spec, built.plan)
            if again is None:
                raise RuntimeError(f"rebuilding the workspace failed ({plan.detail(failed)})")
            return again

        measurer = CudaMeasurer(rank=rank, world=world, device=device, spec=spec, build=build_again,
                                workspace=workspace, nccl_group=None if backend == "gloo" else dist.group.WORLD)
        table = Tuner(measurer, spec, rank=rank, world=world, gather=gather, key=key, progress=emit).run()
        if built.note:
            table.notes.append(f"workspace in pinned host memory: {built.note}")
        emit({"event": "done", "table": table.to_dict(), "digest": table.digest()})
        return 0
    finally:
        if measurer is not None:
            measurer.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.tuning.child")
    for name in ("rank", "world", "device", "port", "parent-pid"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--spec", required=True, help="JSON file of a TuneSpec")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    emit({"event": "start"})
    try:
        return run(args.rank, args.world, args.device, args.port, args.spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        emit({"event": "error", "error": f"{type(exc).__name__}: {exc}",
              "trace": traceback.format_exc(limit=8)[-2000:]})
        return 1


if __name__ == "__main__":
    sys.exit(main())
