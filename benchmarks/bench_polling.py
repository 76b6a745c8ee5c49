"""One-GPU microbenchmark of the one-shot kernels' own work at 8 and 2 ranks: polling and cluster split.

    python -m benchmarks.bench_polling [--out benchmarks/results] [--iters 50] [--calls 50]

One process plays rank 0 of W (8, then 2) on a loopback workspace (csrc/workspace.cu: the peers' slabs are
local allocations, nobody else runs). Before each call a fill kernel writes a ready pattern over rank 0's
whole scratch, so every peer pack of every output pack reads as arrived: what is timed is the kernel's own
work, pushes to W-1 slabs, the loads and tests of W-1 ready packs, the sum, the emptying stores and (fused)
the norm, without any waiting for a peer. Measured in CUDA graphs of `calls` x (fill, call), minus a graph of
`calls` fills alone, per call; median over `iters` replays. Output: polling_<gpu>_loopback.json.

Cases, bf16 [rows, 7168], rows 1, 3, 4, 16, 64:
- polling (8 ranks, rows 1 and 3, plain and fused): variant 3, the polling before I10 (each peer's pack
  loaded, waited on and tested before the next load issues; kept in csrc/ar_kernels.cu for this benchmark
  only), against variant 0, the kernels as they serve (every peer's load issued before any test);
- clusters (fused): one CTA per row (cluster 1) against a row spread over 2, 4 or 8 CTAs of a cluster, and
  the kernels' rule (fused_cluster_size).
On a PCIe box the peer packs are written by other GPUs and the pushes cross PCIe; neither is modelled here.
The numbers say what the kernels' own work costs, nothing about link latency.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.harness import io, microbench, timing

WORLDS = (8, 2)
HIDDEN = 7168
ROWS = (1, 3, 4, 16, 64)
SERIAL, BATCHED = 3, 0  # variant numbers: the polling before I10 (bench only), the one-shot kernels as they serve
# Fused one-shot CTAs per row: 1 = one CTA per row (the kernel before the cluster split), 0 = the kernels' rule
# (fused_cluster_size in csrc/ar_kernels.cu), 2/4/8 forced.
CLUSTERS = (1, 0, 2, 4, 8)
PUSH = 0  # the transport these kernels are timed with (benchmarks/bench_transports.py times all three)


def _refill_then_call(ops, ws, op, variant, cluster, sm_count, t):
    """One step of the timed graph: make every peer pack ready again, then one call (256-thread CTAs for the
    plain kernel, as plain_threads() picks at these sizes)."""
    def call(k):
        ops.ws_loopback_refill(ws)
        if op == "all_reduce":
            ops.all_reduce(ws, t["x"], t["out"], variant, 256, sm_count, True, PUSH)
        else:
            ops.all_reduce_add_rmsnorm(ws, t["x"], t["residual"], t["weight"], 1e-6, t["norm"], t["out"], variant,
                                       sm_count, True, cluster, PUSH)

    return call


def _cases(world: int, rows: int):
    """(op, polling label, variant, cluster) to time for one shape."""
    cases = [("all_reduce", "batched (I10)", BATCHED, 0)]
    if world == 8 and rows in (1, 3):
        cases.insert(0, ("all_reduce", "serial (before I10)", SERIAL, 0))
        cases.append(("all_reduce_add_rmsnorm", "serial (before I10)", SERIAL, 1))
    cases += [("all_reduce_add_rmsnorm", "batched (I10)", BATCHED, c) for c in CLUSTERS]
    return cases


def run(args) -> dict:
    from sgl_kernel_sm120 import _ext

    ops = _ext.ops()
    dev = torch.device("cuda", torch.cuda.current_device())
    records = []
    fill_us = {}
    for world in WORLDS:
        ws = ops.ws_create_loopback(dev.index, world, max(ROWS) * HIDDEN)
        sm_count = int(ops.ws_sm_count(ws))
        try:
            fill_graph, _ = timing.capture_graph(lambda k, ws=ws: ops.ws_loopback_refill(ws), args.calls)
            fill_us[world] = statistics.median(timing.replay_times(fill_graph, args.iters, warmup=args.warmup,
                                                                         sync_each=True)) / args.calls
            for rows in ROWS:
                x = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=dev)
                t = {"x": x, "residual": torch.ones_like(x), "out": torch.empty_like(x), "norm": torch.empty_like(x),
                     "weight": torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)}
                for op, label, variant, cluster in _cases(world, rows):
                    step = _refill_then_call(ops, ws, op, variant, cluster, sm_count, t)
                    graph, _ = timing.capture_graph(step, args.calls)
                    per_call = [v / args.calls - fill_us[world]
                                for v in timing.replay_times(graph, args.iters, warmup=args.warmup, sync_each=True)]
                    # every peer pack holds bf16 1.0 (the fill) and so does every input: the sum is `world`
                    expected = torch.full_like(x, world + (1 if op != "all_reduce" else 0))
                    correct = bool(torch.equal(t["out"], expected))
                    used = None
                    if op != "all_reduce":
                        used = cluster or int(ops.fused_cluster_for(rows, HIDDEN, sm_count,
                                                                    list(ops.ws_launch_limits(ws))[1:]))
                    rec = {
                        "op": op, "world": world, "rows": rows, "hidden": HIDDEN, "dtype": "bfloat16",
                        "polling": label, "variant": variant, "cluster_requested": cluster, "cluster": used,
                        "us_per_call_median": statistics.median(per_call), "us_per_call_min": min(per_call),
                        "result_correct": correct,
                    }
                    records.append(rec)
                    print(f"W={world} {op:24s} [{rows:2d},{HIDDEN}] {label:20s} cluster={used!s:4s} "
                          f"{rec['us_per_call_median']:7.2f} us{'' if correct else '  WRONG RESULT'}", flush=True)
        finally:
            ops.ws_destroy(ws)
    return microbench.document(
        "bench_polling", __doc__, "loopback: rank 0 of W in one process", args, fill_us, records,
        statistic=microbench.LOOPBACK_STATISTIC,
        comparisons=comparisons(records),
        note="loopback: rank 0 of W on one GPU, peer packs pre-filled as ready; pushes land in local memory",
    )


def comparisons(records: list[dict]) -> dict:
    """Serial against batched polling at 8 ranks, [1|3, 7168]; the fused kernel with the
    kernels' cluster rule against the one-CTA-per-row kernel with the old polling (at 8 ranks) and with I10."""
    def pick(**kw):
        found = [r["us_per_call_median"] for r in records if all(r.get(k) == v for k, v in kw.items())]
        return found[0] if found else None

    polling = []
    for op in ("all_reduce", "all_reduce_add_rmsnorm"):
        for rows in (1, 3):
            old = pick(world=8, rows=rows, op=op, variant=SERIAL)
            new = pick(world=8, rows=rows, op=op, variant=BATCHED, cluster_requested=0 if op == "all_reduce" else 1)
            polling.append({"op": op, "rows": rows, "serial_us": old, "batched_us": new,
                            "batched_over_serial": io.ratio(new, old)})
    cluster = []
    for world in WORLDS:
        for rows in ROWS:
            one = pick(world=world, rows=rows, op="all_reduce_add_rmsnorm", variant=BATCHED, cluster_requested=1)
            auto = pick(world=world, rows=rows, op="all_reduce_add_rmsnorm", variant=BATCHED, cluster_requested=0)
            before = pick(world=world, rows=rows, op="all_reduce_add_rmsnorm", variant=SERIAL)
            cluster.append({"world": world, "rows": rows, "one_cta_per_row_us": one, "rule_us": auto,
                            "rule_over_one_cta": io.ratio(auto, one),
                            "serial_one_cta_us": before, "rule_over_serial": io.ratio(auto, before)})
    return {"polling": polling, "cluster": cluster}


def main(argv=None) -> int:
    return microbench.main(run, "polling", __doc__, argv, iters=50, calls=50)


if __name__ == "__main__":
    raise SystemExit(main())
