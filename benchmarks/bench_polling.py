"""One-GPU microbenchmark of the 8-rank one-shot kernels' polling: the old serial waits against I10.

    python -m benchmarks.bench_polling [--out benchmarks/results] [--iters 50] [--calls 50]

One process plays rank 0 of 8 on a loopback workspace (csrc/workspace.cu: the 7 peers' slabs are local
allocations, nobody else runs). Before each call a fill kernel writes a ready pattern over rank 0's whole
scratch, so all 7 peer packs of every output pack read as arrived: what is timed is the kernel's own work,
pushes to 7 slabs, the loads and tests of 7 ready packs, the sum, the emptying stores and (fused) the norm,
without any waiting for a peer. Measured in CUDA graphs of `calls` x (fill, call), minus a graph of `calls`
fills alone, per call; median over `iters` replays.

Variants: 3 = the polling before I10 (each peer's pack loaded, waited on and tested before the next load
issues; kept in csrc/ar_kernels.cu for this benchmark only), 0 = the one-shot kernels as they serve (every
peer's load issued before any test). Shapes [1, 7168] and [3, 7168] bf16, plain and fused.
On a PCIe box the peer packs are written by other GPUs and the pushes cross PCIe; neither is modelled here.
The numbers say how much the kernels' own polling costs, nothing about link latency.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks import common

WORLD = 8
HIDDEN = 7168
ROWS = (1, 3)
POLLING = {"serial (before I10)": 3, "batched (I10)": 0}


def _time_graph(graph: torch.cuda.CUDAGraph, iters: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # us
    return times


def _capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for k in range(2):  # warm-up outside the graph
            fn(k)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for k in range(calls):
            fn(k)
    torch.cuda.synchronize()
    return graph


def _refill_then_call(ops, ws, op, variant, sm_count, x, residual, weight, norm, out):
    """One step of the timed graph: make every peer pack ready again, then one call (256-thread CTAs for the
    plain kernel, as plain_threads() picks at these sizes)."""
    def call(k):
        ops.ws_loopback_refill(ws)
        if op == "all_reduce":
            ops.all_reduce(ws, x, out, variant, 256, sm_count, True)
        else:
            ops.all_reduce_add_rmsnorm(ws, x, residual, weight, 1e-6, norm, out, variant, sm_count, True)

    return call


def run(args) -> dict:
    from sgl_kernel_sm120 import _ext

    ops = _ext.ops()
    dev = torch.device("cuda", torch.cuda.current_device())
    ws = ops.ws_create_loopback(dev.index, WORLD, max(ROWS) * HIDDEN)
    sm_count = int(ops.ws_sm_count(ws))
    records = []
    try:
        fill_graph = _capture(lambda k: ops.ws_loopback_refill(ws), args.calls)
        fill_us = statistics.median(_time_graph(fill_graph, args.iters)) / args.calls
        for rows in ROWS:
            x = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=dev)
            residual = torch.ones_like(x)
            weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)
            out, norm = torch.empty_like(x), torch.empty_like(x)
            for op in ("all_reduce", "all_reduce_add_rmsnorm"):
                for label, variant in POLLING.items():
                    call = _refill_then_call(ops, ws, op, variant, sm_count, x, residual, weight, norm, out)
                    graph = _capture(call, args.calls)
                    per_call = [t / args.calls - fill_us for t in _time_graph(graph, args.iters)]
                    # every peer contributed ones: the sum is WORLD everywhere (the fill wrote bf16 1.0)
                    expected = torch.full_like(x, WORLD + (1 if op != "all_reduce" else 0))
                    correct = bool(torch.equal(out, expected))
                    records.append({
                        "op": op, "rows": rows, "hidden": HIDDEN, "dtype": "bfloat16", "world": WORLD,
                        "polling": label, "variant": variant,
                        "us_per_call_median": statistics.median(per_call),
                        "us_per_call_min": min(per_call),
                        "result_correct": correct,
                    })
                    print(f"{op:24s} [{rows},{HIDDEN}] {label:20s} {statistics.median(per_call):7.2f} us"
                          f"{'' if correct else '  WRONG RESULT'}", flush=True)
    finally:
        ops.ws_destroy(ws)
    comparisons = []
    for rows in ROWS:
        for op in ("all_reduce", "all_reduce_add_rmsnorm"):
            pick = {r["polling"]: r["us_per_call_median"] for r in records if r["rows"] == rows and r["op"] == op}
            old, new = pick["serial (before I10)"], pick["batched (I10)"]
            comparisons.append({"op": op, "rows": rows, "serial_us": old, "batched_us": new,
                                "batched_over_serial": new / old if old > 0 else None})
    return {
        "benchmark": "bench_polling",
        "what": __doc__.strip().splitlines()[0],
        "hardware": f"1x {torch.cuda.get_device_name()} (loopback: rank 0 of {WORLD})",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "calls_per_graph": args.calls,
        "iters": args.iters,
        "fill_us_per_call": fill_us,
        "timestamp": common.utc_now(),
        "records": records,
        "comparisons": comparisons,
        "note": "loopback: rank 0 of 8 on one GPU, peer packs pre-filled as ready; pushes land in local memory",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(common.RESULTS_DIR))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    doc = run(args)
    path = Path(args.out) / f"polling_{common.gpu_slug(torch.cuda.get_device_name())}_loopback8.json"
    common.write_json(path, doc)
    print(f"wrote {path}")
    bad = [r for r in doc["records"] if not r["result_correct"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
