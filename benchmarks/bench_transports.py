"""One-GPU microbenchmark of the kernels' own work for every transport x schedule (issue 17), the successor of
bench_polling for the transports.

    python -m benchmarks.bench_transports [--out benchmarks/results] [--iters 30] [--calls 20]
    python -m benchmarks.bench_transports --table benchmarks/results/transports_h200_loopback.json  (README's table)

Two modes, bf16 [rows, 7168], rows 1, 3, 4, 16, 64, W = 2, 4, 8, plain and fused, push / staged / pull:
- loopback: one process plays rank 0 of W (csrc/workspace.cu: the peers' slabs are local allocations). Before
  each call a fill kernel marks every peer pack as arrived, every peer's pull copy as 1.0 and every flag as
  published, so the call never waits: what is timed is the kernel's own work (stores, loads, sums, norm, the
  staged passes' and pull's flag traffic). Measured in CUDA graphs of `calls` x (fill, call), minus a graph of
  `calls` fills alone, per call. Each (W, rows) gets its own workspace sized for exactly that call: the fill
  writes whole slabs, and a slab sized for 64 rows made the fill 43 us per call at W = 8 against 1-10 us for the
  call (2026-12-02), drowning the difference. Each record keeps its fill time (`fill_us`) to show the margin.
  Each record names its launch (`blocks`, `cluster`: "rule" for the kernels' own choice) and its `config`:
  "default" is what the product launches; "sweep" (rows 3 and 16) forces other CTA counts and cluster sizes to
  diagnose issue 17's misses (_loopback_configs); `sweep` in the JSON sets them beside the default.
  Schedules ONESHOT and flat TWOSHOT (a loopback workspace has no islands);
  one-shot results are checked (every source holds 1.0, so the sum is W), two-shot ones are not (the packs
  this rank does not own come from stand-in owners).
- concurrent: one process runs the whole group (IpcAllReduce.local_group, each rank on a W-th of the SMs) as W
  parallel branches of one CUDA graph, so the ranks really exchange (in one GPU's memory) and wait for one
  another: ONESHOT, TWOSHOT and (W >= 4, two islands) ISLAND. Per call: the graph's replay time / calls.
Median over `iters` replays. Nothing here crosses a link: on a PCIe box the transports differ by what the
fabric does with many posted writes against loads, which only a run there shows (python -m sglang_sm120.tune).
Output: transports_<gpu>_loopback.json.
"""

from __future__ import annotations

import itertools
import statistics

import torch

from benchmarks.harness import microbench, timing
from sgl_kernel_sm120.variants import STAGED_MAX_CTAS, Transport

WORLDS = (2, 4, 8)
HIDDEN = 7168
ROWS = (1, 3, 4, 16, 64)
TRANSPORTS = {t.value: t.code for t in Transport}
OPS = ("all_reduce", "all_reduce_add_rmsnorm")
SWEEP_ROWS = (3, 16)  # the diagnostic sweep's shapes (_loopback_configs): a decode step and a verify step
SWEEP_CLUSTERS = (1, 2, 4, 8)  # the fused one-shot's CTAs per row the kernels build


def default_blocks(transport: str, sm: int) -> int:
    """The CTAs the product gives a call: staged push is capped (STAGED_MAX_CTAS), the others take the grid."""
    return min(sm, STAGED_MAX_CTAS) if transport == "staged" else sm


class LoopbackCall:
    """One loopback call's tensors and launch (also benchmarks/profile_transports.py): every source and the residual
    hold 1.0, so a one-shot's residual/sum output must be W (+ 1 when fused)."""

    def __init__(self, ops, ws, world: int, rows: int, dev, variant: int, transport: str, op: str, blocks: int,
                 cluster: int = 0, threads: int = 256, window: int = 0):
        self.ops, self.ws, self.world, self.op = ops, ws, world, op
        self.variant, self.code, self.blocks, self.cluster = variant, TRANSPORTS[transport], blocks, cluster
        self.threads, self.window = threads, window  # plain kernels' CTA size; staged push's window (0: default)
        self.x = torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=dev)
        self.out, self.norm, self.res = torch.empty_like(self.x), torch.empty_like(self.x), torch.ones_like(self.x)
        self.weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)

    def __call__(self, k=None) -> None:
        """Refill the stand-in peers, then the call (k: timing.capture_graph's call index, unused)."""
        self.ops.ws_loopback_refill(self.ws)
        if self.op == "all_reduce":
            self.ops.all_reduce(self.ws, self.x, self.out, self.variant, self.threads, self.blocks, True, self.code,
                                self.window)
        else:
            self.ops.all_reduce_add_rmsnorm(self.ws, self.x, self.res, self.weight, 1e-6, self.norm, self.out,
                                            self.variant, self.blocks, True, self.cluster, self.code, self.window)

    def one_shot_correct(self) -> bool:
        return bool(torch.equal(self.out, torch.full_like(self.x, self.world + (self.op != "all_reduce"))))


def _loopback_configs(world: int, rows: int, sm: int):
    """(variant, transport, op, blocks, cluster, config) of every loopback call timed at (world, rows).

    config "default" is what the product launches (staged capped at STAGED_MAX_CTAS, the fused one-shot's cluster
    by the kernels' own rule: cluster 0); the README table and the summary use these only. config "sweep" is the
    diagnosis of issue 17's two misses, at rows SWEEP_ROWS: staged on the whole grid (at W = 2 it has one pass,
    the very stores push makes, so a gap to push there is its CTA cap or its one pacing barrier), and the fused
    one-shot with every cluster size forced (is the W = 8 fused cost the cluster split or the row's work?)."""
    variants = [("ONESHOT", 0)] + ([("TWOSHOT", 1)] if world > 2 else [])
    for (vname, variant), tname, op in itertools.product(variants, TRANSPORTS, OPS):
        yield vname, variant, tname, op, default_blocks(tname, sm), 0, "default"
    if rows not in SWEEP_ROWS:
        return
    for op in OPS:
        yield "ONESHOT", 0, "staged", op, sm, 0, "sweep"
    for tname, cluster in itertools.product(TRANSPORTS, SWEEP_CLUSTERS):
        yield "ONESHOT", 0, tname, "all_reduce_add_rmsnorm", default_blocks(tname, sm), cluster, "sweep"


def _loopback(args, dev) -> tuple[list[dict], dict]:
    from sgl_kernel_sm120 import _ext

    ops = _ext.ops()
    records, fill_us = [], {}
    for world, rows in itertools.product(WORLDS, ROWS):
        ws = ops.ws_create_loopback(dev.index, world, rows * HIDDEN)
        sm = int(ops.ws_sm_count(ws))
        try:
            fill_graph, _ = timing.capture_graph(lambda k, ws=ws: ops.ws_loopback_refill(ws), args.calls)
            fill = statistics.median(timing.replay_times(fill_graph, args.iters, sync_each=True)) / args.calls
            fill_us[f"{world}x{rows}"] = fill
            for vname, variant, tname, op, blocks, cluster, config in _loopback_configs(world, rows, sm):
                call = LoopbackCall(ops, ws, world, rows, dev, variant, tname, op, blocks, cluster)
                graph, _ = timing.capture_graph(call, args.calls)
                per_call = [v / args.calls - fill for v in timing.replay_times(graph, args.iters, sync_each=True)]
                correct = call.one_shot_correct() if variant == 0 else None  # two-shot: stand-in owners (above)
                rec = {"mode": "loopback", "op": op, "world": world, "rows": rows, "hidden": HIDDEN,
                       "dtype": "bfloat16", "variant": vname, "transport": tname, "config": config,
                       "blocks": blocks, "cluster": cluster or "rule",
                       "us_per_call_median": statistics.median(per_call), "us_per_call_min": min(per_call),
                       "fill_us": fill, "result_correct": correct}
                records.append(rec)
                shown = f"{config}: {blocks} CTAs" + (f", cluster {cluster}" if cluster else "")
                print(f"loopback W={world} {op:24s} [{rows:2d},{HIDDEN}] {vname:8s} {tname:6s} "
                      f"{rec['us_per_call_median']:7.2f} us (fill {fill:5.2f} us; {shown})"
                      f"{'  WRONG RESULT' if correct is False else ''}", flush=True)
        finally:
            ops.ws_destroy(ws)
    return records, fill_us


def _concurrent(args, dev) -> list[dict]:
    from sgl_kernel_sm120 import IpcAllReduce, Variant
    from sgl_kernel_sm120.ipc_allreduce import close_local_group

    records = []
    for world in WORLDS:
        islands = [list(range(world // 2)), list(range(world // 2, world))] if world >= 4 else None
        comms = IpcAllReduce.local_group(dev, world, max(ROWS) * HIDDEN, islands=islands, timeout_s=10.0)
        streams = [torch.cuda.Stream() for _ in range(world)]
        variants = [Variant.ONESHOT] + ([Variant.TWOSHOT] if world > 2 else []) + ([Variant.ISLAND] if islands else [])
        try:
            for rows, variant, transport, op in itertools.product(ROWS, variants, TRANSPORTS, OPS):
                xs = [torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(world)]
                res = torch.ones_like(xs[0])
                w = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)
                outs: list = [None] * world

                def call(r, comms=comms, xs=xs, res=res, w=w, variant=variant, transport=transport, op=op, outs=outs):
                    if op == "all_reduce":
                        outs[r] = comms[r].all_reduce(xs[r], variant=variant, transport=transport)
                    else:
                        outs[r] = comms[r].all_reduce_add_rmsnorm(xs[r], res, w, 1e-6, variant=variant,
                                                                  transport=transport)[1]

                def calls(r):
                    for _ in range(args.calls):
                        call(r)

                # Warm-up, eager, each rank on its own stream, call-major (IpcAllReduce.local_group: lazy loading).
                for _ in range(args.calls):
                    for r in range(world):
                        with torch.cuda.stream(streams[r]):
                            call(r)
                torch.cuda.synchronize()
                main = torch.cuda.Stream()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=main):
                    for s in streams:
                        s.wait_stream(main)
                    for r in range(world):
                        with torch.cuda.stream(streams[r]):
                            calls(r)
                    for s in streams:
                        main.wait_stream(s)
                per_call = [v / args.calls for v in timing.replay_times(graph, args.iters, warmup=2)]
                expected = torch.full_like(xs[0], world + (op != "all_reduce"))
                correct = all(torch.equal(o, expected) for o in outs) and all(c.timeout_error() is None for c in comms)
                rec = {"mode": "concurrent", "op": op, "world": world, "rows": rows, "hidden": HIDDEN,
                       "dtype": "bfloat16", "variant": variant.name, "transport": transport,
                       "us_per_call_median": statistics.median(per_call), "us_per_call_min": min(per_call),
                       "result_correct": correct}
                records.append(rec)
                print(f"concurrent W={world} {op:24s} [{rows:2d},{HIDDEN}] {variant.name:8s} {transport:6s} "
                      f"{rec['us_per_call_median']:7.2f} us{'' if correct else '  WRONG RESULT'}", flush=True)
                del graph
                if not correct:
                    break  # a wrong result or a timeout poisons the group: stop this world's sweep
        finally:
            close_local_group(comms)
    return records


def _is_default(record: dict) -> bool:
    """What the product launches (records written before the sweep existed have no config: all default)."""
    return record.get("config", "default") == "default"


def sweep_summary(records: list[dict]) -> list[dict]:
    """The diagnostic sweep beside the default launch, per (world, rows, op, transport) of the sweep: the one-shot's
    median us per configuration ("default", "<N> CTAs", "cluster <c>"); a wrong result shows as None."""
    def us(r):
        return r["us_per_call_median"] if r["result_correct"] is not False else None

    out = []
    swept = sorted({(r["world"], r["rows"], r["op"], r["transport"]) for r in records if not _is_default(r)})
    for world, rows, op, transport in swept:
        same = [r for r in records if r["mode"] == "loopback" and r["variant"] == "ONESHOT"
                and (r["world"], r["rows"], r["op"], r["transport"]) == (world, rows, op, transport)]
        by_config = {}
        for r in same:
            if _is_default(r):
                by_config["default"] = us(r)
            elif r["cluster"] != "rule":
                by_config[f"cluster {r['cluster']}"] = us(r)
            else:
                by_config[f"{r['blocks']} CTAs"] = us(r)
        out.append({"world": world, "rows": rows, "op": op, "transport": transport, "us_by_config": by_config})
    return out


def summary(records: list[dict]) -> list[dict]:
    """Per (mode, world, rows, op): the best transport x schedule as launched by default (the sweep's forced
    configurations are diagnosis, see sweep_summary), and push's one-shot for comparison."""
    out = []
    keys = sorted({(r["mode"], r["world"], r["rows"], r["op"]) for r in records})
    for mode, world, rows, op in keys:
        rs = [r for r in records if (r["mode"], r["world"], r["rows"], r["op"]) == (mode, world, rows, op)
              and r["result_correct"] is not False and _is_default(r)]
        if not rs:
            continue
        best = min(rs, key=lambda r: r["us_per_call_median"])
        push = [r for r in rs if r["transport"] == "push" and r["variant"] == "ONESHOT"]
        out.append({"mode": mode, "world": world, "rows": rows, "op": op,
                    "best": f"{best['variant']} {best['transport']}", "best_us": best["us_per_call_median"],
                    "push_oneshot_us": push[0]["us_per_call_median"] if push else None})
    return out


def readme_table(records: list[dict], rows: int = 3, worlds=(2, 8)) -> str:
    """README's transports table: one-shot, bf16 [rows, 7168], us per call as "plain / fused", per mode and world
    (the issue's targets are at 2 and 8 ranks; tests/bench/test_transports_summary.py checks that README holds
    this rendering of the committed JSON)."""
    def cell(mode, world, transport):
        found = {r["op"]: r for r in records if (r["mode"], r["world"], r["rows"], r["variant"], r["transport"])
                 == (mode, world, rows, "ONESHOT", transport) and r["result_correct"] is not False
                 and _is_default(r)}
        if "all_reduce" not in found or "all_reduce_add_rmsnorm" not in found:
            return "-"
        return (f"{found['all_reduce']['us_per_call_median']:.2f} / "
                f"{found['all_reduce_add_rmsnorm']['us_per_call_median']:.2f}")

    lines = ["| mode | ranks | push | staged push | pull |", "|---|---|---|---|---|"]
    for mode in ("loopback", "concurrent"):
        for world in worlds:
            if any(r["mode"] == mode and r["world"] == world for r in records):
                lines.append(f"| {mode} | {world} | " + " | ".join(cell(mode, world, t) for t in TRANSPORTS) + " |")
    return "\n".join(lines)


def run(args) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    records, fill_us = _loopback(args, dev)
    records += _concurrent(args, dev)
    return microbench.document(
        "bench_transports", __doc__, "loopback and one-process concurrent groups", args, fill_us, records,
        summary=summary(records), sweep=sweep_summary(records),
        note="one GPU: no link is crossed; concurrent ranks each get a W-th of the SMs",
    )


def main(argv=None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:  # --table FILE: print README's table from a result JSON
        import json

        with open(argv[1]) as f:
            print(readme_table(json.load(f)["records"]))
        return 0
    return microbench.main(run, "transports", __doc__, argv, iters=30, calls=20)


if __name__ == "__main__":
    raise SystemExit(main())
