"""Quick latency probe of our ops against NCCL at the Kimi-K2.5 shapes (a smoke check for a GPU session;
benchmarks/bench_allreduce.py is the real benchmark). torchrun --nproc-per-node 2 scripts/probe_latency.py"""

import functools
import os
import statistics

import torch
import torch.distributed as dist

from sgl_kernel_sm120 import IpcAllReduce, Schedule


def graph_time_us(fn, calls=20, replays=50, warmup=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    t = torch.tensor(times)
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t, group=GLOO)
    return statistics.median(torch.stack(gathered).max(0).values.tolist())


rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
GLOO = dist.new_group(backend="gloo")
ar = IpcAllReduce(GLOO, rank, 256 * 7168, islands=[[r] for r in range(world)] if world == 2 else None)
for pdl in (True, False):
    ar.use_pdl = pdl
    for threads in (128, 256, 512):
        for rows in (1, 3, 16, 64, 256):
            x = torch.randn(rows, 7168, dtype=torch.bfloat16, device="cuda")
            res = torch.randn_like(x)
            w = torch.randn(7168, dtype=torch.bfloat16, device="cuda")
            row = {}
            for v in (Schedule.ONESHOT, Schedule.TWOSHOT):
                row[f"ar-{v.name}"] = graph_time_us(functools.partial(ar.all_reduce, x, schedule=v, threads=threads))
                if threads == 256:
                    fused = functools.partial(ar.all_reduce_add_rmsnorm, x, res, w, 1e-6, schedule=v)
                    row[f"fused-{v.name}"] = graph_time_us(fused)
            if threads == 256 and pdl:
                row["nccl"] = graph_time_us(functools.partial(dist.all_reduce, x))
            if rank == 0:
                cells = " ".join(f"{k}={v:.2f}" for k, v in row.items())
                print(f"pdl={pdl} threads={threads} rows={rows}: {cells}", flush=True)
ar.close()
dist.destroy_process_group()
