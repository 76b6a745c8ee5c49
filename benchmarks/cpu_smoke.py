#!/usr/bin/env python3
"""CPU smoke run of the benchmarks' control flow, for machines without GPUs (CI, development).

    python benchmarks/cpu_smoke.py allreduce --out /tmp/x -- --sizes 1K,64K --rows 1,3 --iters 3
    python benchmarks/cpu_smoke.py verify --out /tmp/x -- --config tiny_test --tokens 1,3 --compute none,gemm
    python benchmarks/cpu_smoke.py allreduce --out /tmp/x -- --no-p2p --sizes none --rows 1,3 --iters 3

Starts N processes over gloo (no torchrun needed) in which CUDA graphs and events are faked (a "graph" re-runs
the captured Python calls; events read the host clock), the NCCL group is a gloo group, and
``sgl_kernel_sm120`` is replaced by a stand-in that all-reduces in fp32 over its gloo group and applies the
reference add + RMSNorm (``memory="host"`` included: it only changes the reported memory and link). With
--no-p2p the benchmark's real NCCL set-up runs (it sets NCCL_P2P_DISABLE=1 in the worker's environment), though
no NCCL is there to read it. The numbers are meaningless; what it checks is that the scripts run end to end, agree
across ranks, record what cannot run here as skipped, and write valid JSON and plots.
"""

from __future__ import annotations

import argparse
import enum
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------
# Fakes (installed inside each worker process)


def _fake_kernel_module():
    import torch
    import torch.distributed as dist

    from benchmarks.harness.norms import reference_add_rmsnorm

    mod = types.ModuleType("sgl_kernel_sm120")

    class Schedule(enum.IntEnum):
        ONESHOT = 0
        TWOSHOT = 1
        ISLAND = 2

    class IpcAllReduce:
        def __init__(self, group, device, max_numel, dtype=torch.bfloat16, *, islands=None, link="auto",
                     memory="device", timeout_s=None, warn_after_s=None):
            if memory not in ("device", "host"):
                raise ValueError(f"memory must be 'device' or 'host', got {memory!r}")
            if memory == "host" and islands is not None:
                raise ValueError("memory='host' takes no islands")
            self.group, self.device, self.max_numel, self.islands = group, device, int(max_numel), islands
            self.memory = memory
            self.link = types.SimpleNamespace(value="host" if memory == "host" else "fake")
            self.closed = False

        def supports(self, inp):
            return 0 < inp.numel() <= self.max_numel and inp.numel() % 8 == 0 and inp.is_contiguous()

        def supports_add_rmsnorm(self, inp):
            return self.supports(inp) and inp.dim() == 2

        shape = None

        def _check(self, schedule):
            if self.closed:
                raise RuntimeError("closed")
            if schedule is not None and Schedule(schedule) is Schedule.ISLAND and not self.islands:
                raise ValueError("Schedule.ISLAND needs a workspace created with islands")
            if schedule is not None and Schedule(schedule) is Schedule.ISLAND and self.memory == "host":
                raise ValueError("Schedule.ISLAND is not available with memory='host'")

        def _sum(self, inp):
            s = inp.float().clone()
            dist.all_reduce(s, group=self.group)
            return s

        def all_reduce(self, inp, out=None, *, schedule=None):
            self._check(schedule)
            res = self._sum(inp).to(inp.dtype)
            if out is None:
                return res
            out.copy_(res)
            return out

        def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out=None, residual_out=None, *,
                                   schedule=None):
            self._check(schedule)
            r = (self._sum(inp) + residual.float()).to(inp.dtype)
            n = reference_add_rmsnorm(r, None, weight, eps)[0]
            if norm_out is not None:
                norm_out.copy_(n)
                n = norm_out
            if residual_out is not None:
                residual_out.copy_(r)
                r = residual_out
            return n, r

        def close(self):
            self.closed = True

    mod.Schedule = Schedule
    mod.IpcAllReduce = IpcAllReduce
    mod.seed_route = lambda nbytes, shape: types.SimpleNamespace(schedule=Schedule.ONESHOT)
    return mod


class _FakeEvent:
    def __init__(self, enable_timing=False, **_):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0


class _FakeGraph:
    def __init__(self, run):
        self._run = run

    def replay(self):
        self._run()


def install_fakes() -> None:
    sys.path[:0] = [str(_ROOT / "python"), str(_ROOT)]
    import torch
    import torch.distributed as dist

    from benchmarks.harness import hardware, io, ranks, timing

    sys.modules["sgl_kernel_sm120"] = _fake_kernel_module()
    torch.cuda.Event = _FakeEvent
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None

    def fake_capture_graph(step, calls, *, eager_warmup=1, stream=None):
        for _ in range(eager_warmup):
            for k in range(calls):
                step(k)
        outs = [step(k) for k in range(calls)]
        return _FakeGraph(lambda: [step(k) for k in range(calls)]), outs

    def fake_init_distributed(gloo_timeout_s: float = 600.0):
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=gloo_timeout_s))
        gloo = dist.new_group(backend="gloo")
        return ranks.Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                           torch.device("cpu"), gloo, dist.group.WORLD)

    def fake_hardware_info(d=None):
        return {"gpu": "CPU smoke (fake)", "gpu_slug": "cpu-smoke-fake", "capability": None, "driver": None,
                "cuda": None, "torch": torch.__version__, "nccl": None, "world_size": d.world_size if d else 1,
                "versions": {}, "env": {}, "note": "benchmarks/cpu_smoke.py: control-flow test, numbers meaningless"}

    from benchmarks import bench_verify

    bench_verify.init_shared_gpu = lambda script: fake_init_distributed()  # --shared-gpu: the same gloo processes
    io.TABLE_TAG = "[CPU smoke, fake numbers] "
    ranks.require_multi_gpu = lambda *a, **k: None
    ranks.init_distributed = fake_init_distributed
    timing.capture_graph = fake_capture_graph
    hardware.hardware_info = fake_hardware_info


def worker(which: str, argv: list[str]) -> int:
    install_fakes()
    torch_threads = os.environ.get("SMOKE_TORCH_THREADS")
    if torch_threads:
        import torch

        torch.set_num_threads(int(torch_threads))
    if which == "allreduce":
        from benchmarks import bench_allreduce as mod
    else:
        from benchmarks import bench_verify as mod
    return mod.main(argv)


def launch(which: str, argv: list[str], world: int = 2, timeout_s: float = 300.0) -> list[subprocess.CompletedProcess]:
    """Run ``which`` (allreduce | verify) in ``world`` processes; returns their completed processes."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                    "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                    "SMOKE_TORCH_THREADS": env.get("SMOKE_TORCH_THREADS", "2"), "PYTHONUNBUFFERED": "1"})
        env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), str(_ROOT / "python"), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", which, "--", *argv]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    done = []
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    return done


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, rest = argv[:cut], argv[cut + 1 :]
    else:
        own, rest = argv, []
    if own[:1] == ["--worker"]:
        return worker(own[1], rest)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=["allreduce", "verify"], help="the benchmark to run")
    p.add_argument("--world", type=int, default=2, help="ranks (processes)")
    p.add_argument("--out", default=None, help="results folder (passed to the benchmark as --out)")
    a = p.parse_args(own)
    if a.out:
        rest = ["--out", a.out, *rest]
    results = launch(a.which, rest, a.world)
    for rank, r in enumerate(results):
        print(f"----- rank {rank} (rc {r.returncode}) -----")
        print(r.stdout)
    return max(r.returncode for r in results)


if __name__ == "__main__":
    sys.exit(main())
