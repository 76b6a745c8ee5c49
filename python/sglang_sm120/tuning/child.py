"""One rank of a tune as its own process (started by tuning/processes.py), so that a candidate that kills its CUDA
context kills this process only. It joins the other ranks on 127.0.0.1:PORT (NCCL for the incumbent, gloo for
every agreement) and computes the table key as a server's ranks do; with `if_missing` it stops when every rank finds
a table of that key, else it runs the Tuner without the candidates blamed under the key. It reports one JSON object
a line after MARKER: "setup" once, "begin" before every candidate, then "done" (the table), "found" or "error".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import traceback

MARKER = "@@sm120-tune "
INIT_TIMEOUT_S = 300.0


def emit(event: dict) -> None:
    print(MARKER + json.dumps(event, sort_keys=True), flush=True)


def _setup(rank: int, world: int, gather, device) -> tuple[dict, list | None, str, str]:
    """(key, islands, link, memory) of this group as a server computes them, agreed (rank 0's probe)."""
    from ..core import config
    from ..core.facts import group_facts, key_facts, p2p_row
    from ..core.topology import kernel_islands, probe
    from ..routing.table import make_key

    everyone = gather({"key": key_facts(device), "p2p": p2p_row(device.index)})
    p2p = group_facts([{"uuid": e["key"]["uuid"], "p2p": e["p2p"], "capability": [0, 0]} for e in everyone]).p2p
    connected = p2p is not None and all(all(row) for row in p2p)
    if not connected and config.settings_from_environment().hostmem == "off":
        raise RuntimeError(f"CUDA P2P is missing between some GPUs and {config.HOSTMEM_ENV}=off refuses the "
                           "host-memory workspace: nothing of ours to tune")
    memory, islands, link = ("device" if connected else "host"), None, "auto"
    if connected:
        probed = None
        if rank == 0:
            topo = probe([e["key"]["uuid"] for e in everyone])
            probed = {"islands": kernel_islands(topo.islands(), world), "link": topo.link}
        agreed = gather(probed)[0]
        islands, link = agreed["islands"], agreed["link"]
    key = make_key([e["key"] for e in everyone], islands=islands, p2p=p2p, memory=memory)
    return key, islands, link, memory


def run(rank: int, world: int, device_index: int, port: int, spec_path: str) -> int:
    import torch
    import torch.distributed as dist

    from ..core.facts import launch_facts
    from ..routing import cache
    from .measure import CudaMeasurer
    from .tuner import Tuner, TuneSpec

    with open(spec_path, encoding="utf-8") as handle:
        spec = TuneSpec(**json.load(handle))
    torch.cuda.set_device(device_index)
    device = torch.device("cuda", device_index)
    # A debug run that injects NCCL's time (ranks sharing one GPU, where NCCL refuses to start) runs on gloo alone.
    backend = "gloo" if spec.debug_nccl_us is not None else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    measurer = None
    try:
        gloo = dist.new_group(backend="gloo")

        def gather(obj):
            out: list = [None] * world
            dist.all_gather_object(out, obj, group=gloo)
            return out

        key, islands, link, memory = _setup(rank, world, gather, device)
        measurer = CudaMeasurer(rank=rank, world=world, device=device, cpu_group=gloo,
                                nccl_group=None if backend == "gloo" else dist.group.WORLD, spec=spec,
                                islands=islands, link=link, memory=memory)
        # The launch facts of the workspace the candidates run on are part of the key, as in a server.
        key = {**key, "launch": launch_facts(measurer._workspace())}
        emit({"event": "setup", "memory": memory, "islands": islands, "link": link, "key": key})
        if spec.if_missing:
            loaded = [cache.load(key, hidden=spec.hidden, dtype=dtype, kinds=spec.kinds) for dtype in spec.dtypes]
            views = gather([found.table.digest() if found.ok else found.describe() for found in loaded])
            if all(found.ok for found in loaded) and all(view == views[0] for view in views):
                emit({"event": "found", "path": loaded[0].path})
                return 0
        # Every rank's read of the blamed candidates, so that every rank excludes the same.
        for entry in [entry for blamed in gather(cache.blames(key)) for entry in blamed]:
            rule = {field: entry[field] for field in ("dtype", "kind", "candidate", "from_bytes")}
            if not any({f: r.get(f) for f in rule} == rule for r in spec.exclude):
                spec.exclude.append({**rule, "reason": f"blamed before: {entry.get('reason')}"})
        table = Tuner(measurer, spec, rank=rank, world=world, gather=gather, key=key, progress=emit).run()
        emit({"event": "done", "table": table.to_dict(), "digest": table.digest()})
        return 0
    finally:
        if measurer is not None:
            measurer.close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.tuning.child")
    for name in ("rank", "world", "device", "port"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--spec", required=True, help="JSON file of a TuneSpec")
    args = parser.parse_args(argv)
    try:
        return run(args.rank, args.world, args.device, args.port, args.spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which decides
        emit({"event": "error", "error": f"{type(exc).__name__}: {exc}",
              "trace": traceback.format_exc(limit=8)[-2000:]})
        return 1


if __name__ == "__main__":
    sys.exit(main())
