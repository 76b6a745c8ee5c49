"""The Python cost of one eager call through the overlay's hooks, on CPU with stand-in ops.

    python -m benchmarks.bench_hot_path --label after [--out benchmarks/results/hot_path_overhead_cpu.json]

Eager calls (prefill, or CUDA graphs off) run the overlay's Python on every all-reduce and every layer boundary;
graph replays run none. Timed here, per call, median of repeats:
- plain: the replaced `GroupCoordinator.all_reduce` on a [4, 7168] bf16 tensor, through the backend's check
  and route lookup, to the workspace's launch;
- fused: one layer boundary as SGLang makes it: the fusion gate at the source, then the replaced
  `_forward_with_allreduce_fusion` at the norm (which asks the gate again and runs the fused launch).
The workspace is the real `IpcAllReduce` object, built without a GPU (its fields set as a construction on a
PCIe box of 8 ranks would) and with the compiled ops replaced by Python no-ops, so what is timed is the
overlay's and the kernel package's Python, not a kernel: the checks, the route lookup, the output allocation.
The tensors are CPU tensors: the workspace's device is set to the CPU so that its device check passes. SGLang's
group lookup is served by a stand-in `get_parallel`. The result is merged into --out under --label, with the
commit and the machine. Both labels of one file are to be measured back to back on one machine (a "before" from
a worktree of the earlier commit, with its own kernel library), since a shared CPU's noise exceeds the effect.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROWS, HIDDEN, WORLD = 4, 7168, 8


def _stand_in_ops():
    def noop(*args, **kwargs):
        return None

    return types.SimpleNamespace(all_reduce=noop, all_reduce_add_rmsnorm=noop)


def build(patch=setattr):
    """(plain call, fused boundary) closures over the overlay's real hooks and a CPU workspace. `patch(obj, name,
    value)` stands in the compiled ops and SGLang's group lookup (a test passes monkeypatch.setattr to undo it)."""

    from sgl_kernel_sm120 import _ext, policy
    from sgl_kernel_sm120.ipc_allreduce import IpcAllReduce
    from sgl_kernel_sm120.settings import read
    from sglang_sm120.core.config import OverlaySettings
    from sglang_sm120.core.gate import GateDecision
    from sglang_sm120.hooks import distributed, fusion
    from sglang_sm120.routing.book import RouteBook
    from sglang_sm120.runtime.backend import TPBackend
    from sglang_sm120.runtime.registry import set_group_backend

    limits = policy.kernel_limits()  # from the built library, before its ops are stood in
    ops = _stand_in_ops()
    patch(_ext, "ops", lambda: ops)
    cpu = torch.device("cpu")
    # The fields a construction on a PCIe box of 8 ranks sets, on the CPU (nothing here reaches a GPU).
    ws = IpcAllReduce.__new__(IpcAllReduce)
    ws.rank, ws.world_size, ws.device, ws.max_numel, ws.dtype = 0, WORLD, cpu, 64 * HIDDEN, torch.bfloat16
    ws.settings, ws.use_pdl, ws._handle, ws.limits = read(), True, 1, limits
    ws.timeout_s, ws.warn_after_s = 300.0, 5.0
    ws.fused_clusters = {"clusters": [2, 4, 8], "reason": "stand-in"}
    ws._shape = policy.WorkspaceShape(WORLD, "device", "pcie", 1, 1 << 62, (2, 4, 8), 188)

    backend = TPBackend(name="tp:0", ranks=list(range(WORLD)), rank_in_group=0, world_size=WORLD, device=cpu,
                        settings=OverlaySettings(mode="on"), deterministic=False)
    backend.decision = GateDecision(True, "bench")
    backend.workspace, backend.hidden_size, backend.dtype = ws, HIDDEN, torch.bfloat16
    backend.max_bytes, backend.max_fused_tokens = 64 * HIDDEN * 2, 64
    backend.routes = RouteBook.seeds(ws.shape, limits)
    backend.fused_tokens = frozenset(range(1, 65))

    group = types.SimpleNamespace(unique_name="tp:0", world_size=WORLD)
    set_group_backend(group, backend)
    backend._group = lambda: group
    parallel = types.SimpleNamespace(tp_group=group, attn_tp_group=group, moe_tp_group=group, moe_ep_group=group)
    # SGLang's group lookup (0.5.23's runtime context, as either release is found) answers with `group`
    patch(distributed, "_groups", types.SimpleNamespace(get_parallel=lambda: parallel))

    def never(*args, **kwargs):
        raise AssertionError("SGLang's own path was taken: the overlay declined the call")

    all_reduce = distributed.wrap_group_all_reduce(never)
    gate = fusion.wrap_fusion_gate(lambda n: False)
    fused = fusion.replace_forward_with_allreduce_fusion(never)
    norm = types.SimpleNamespace(variance_epsilon=1e-6)
    x = torch.zeros(ROWS, HIDDEN, dtype=torch.bfloat16)
    residual, weight = torch.zeros_like(x), torch.ones(HIDDEN, dtype=torch.bfloat16)

    def plain():
        all_reduce(group, x)

    def boundary():
        assert gate(ROWS)
        fused(norm, x, residual, None, weight)

    return plain, boundary


def per_call_us(fn, calls: int, repeats: int) -> dict:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls / 1000.0)
    return {"median_us": round(statistics.median(samples), 3), "min_us": round(min(samples), 3),
            "samples_us": [round(s, 3) for s in samples], "calls_per_sample": calls}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the run's name in the JSON (e.g. before, after)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                              "hot_path_overhead_cpu.json"))
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed sample")
    parser.add_argument("--repeats", type=int, default=9, help="timed samples; the median is reported")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plain, boundary = build()
    run = {"commit": commit(), "python": platform.python_version(), "torch": torch.__version__,
           "cpu": platform.processor() or platform.machine(), "shape": [ROWS, HIDDEN], "world": WORLD,
           "plain": per_call_us(plain, args.calls, args.repeats),
           "fused_boundary": per_call_us(boundary, args.calls, args.repeats)}
    doc = {"benchmark": "hot_path_overhead", "what": "Python cost per eager call (us), stand-in ops, CPU",
           "runs": {}}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as handle:
            doc = json.load(handle)
    doc["runs"][args.label] = run
    if {"before", "after"} <= set(doc["runs"]):  # the target: at least 2x lower
        before, after = doc["runs"]["before"], doc["runs"]["after"]
        doc["before_over_after"] = {op: round(before[op]["median_us"] / after[op]["median_us"], 2)
                                    for op in ("plain", "fused_boundary")}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
        handle.write("\n")
    print(f"{args.label} ({run['commit']}): plain {run['plain']['median_us']} us, fused boundary "
          f"{run['fused_boundary']['median_us']} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
