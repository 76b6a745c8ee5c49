"""The Python cost of one eager call through the overlay's hooks, on CPU with stand-in ops.

    git clone --shared . $BEFORE && git -C $BEFORE checkout 378f36b   # the commit to compare with
    python -m benchmarks.bench_hot_path --before $BEFORE --before-library $BEFORE_SO [--rounds 7] \
        [--target fused_boundary=2]

Eager calls (prefill, or CUDA graphs off) run the overlay's Python on every all-reduce and every layer boundary;
graph replays run none. Timed here, per call, median of repeats:
- plain: the replaced `GroupCoordinator.all_reduce` on a [4, 7168] bf16 tensor, through the backend's check
  and route lookup, to the workspace's launch;
- fused: one layer boundary as SGLang makes it: the norm's ask of the fusion gate, then the replaced
  `_forward_with_allreduce_fusion` it promises, which runs the fused launch.
The workspace is the real `IpcAllReduce` object, built without a GPU (its fields set as a construction on a
PCIe box of 8 ranks would) and with the compiled ops replaced by Python no-ops, so what is timed is the
overlay's and the kernel package's Python, not a kernel: the checks, the route lookup, the output allocation.
The tensors are CPU tensors: the workspace's device is set to the CPU so that its device check passes. SGLang's
group lookup is served by a stand-in `get_parallel`. Each run also counts the predicates of one call
(`predicates`: the conditional jumps Python executes, by where their code lives). With --before, both are
measured in fresh processes in alternating rounds on one machine, since a shared CPU's slow spells exceed the
effect; the JSON keeps every comparison made, each with its rounds and the median over rounds of before / after.
Without it, this checkout alone under --label.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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
    from sglang_sm120.routing.book import SEEDS, RouteBook
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
    backend.routes = RouteBook(SEEDS, shape=ws.shape, limits=limits)
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
    gate = fusion.wrap_norm_gate(lambda n: False)
    fused = fusion.replace_forward_with_allreduce_fusion(never)
    fusion.serve(backend)
    norm = torch.nn.Module()  # what the overlay reads of an SGLang RMSNorm: its epsilon, and that it is plain
    norm.variance_epsilon = 1e-6
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


def predicates(call) -> dict:
    """The conditional jumps Python executes in one steady-state `call` (each `if`, each operand of `and`/`or`
    that is tested, each loop or comprehension condition), by where their code lives: the overlay, the kernel
    package, torch. The caller's own frames are not counted."""
    import dis

    import sgl_kernel_sm120
    import sglang_sm120

    jumps = {op for name, op in dis.opmap.items() if "_IF_" in name}
    roots = {"overlay": os.path.dirname(sglang_sm120.__file__), "kernel_package": os.path.dirname(
        sgl_kernel_sm120.__file__), "torch": os.path.dirname(torch.__file__)}
    counts = dict.fromkeys(roots, 0)

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode" and frame.f_code.co_code[frame.f_lasti] in jumps:
            for where, root in roots.items():
                if frame.f_code.co_filename.startswith(root):
                    counts[where] += 1
        return trace

    call()
    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return counts


def measure_here(calls: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    plain, boundary = build()
    return {"commit": commit(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "shape": [ROWS, HIDDEN], "world": WORLD,
            "plain": per_call_us(plain, calls, repeats), "fused_boundary": per_call_us(boundary, calls, repeats)}


def predicates_in(checkout: str, library: str) -> dict:
    """This file's predicate count applied to `checkout`'s own benchmark calls, in a fresh process there."""
    code = ("import json, runpy, sys; count = runpy.run_path(sys.argv[1])['predicates']; "
            "from benchmarks.bench_hot_path import build; plain, boundary = build(); "
            "print(json.dumps({'plain': count(plain), 'fused_boundary': count(boundary)}))")
    done = subprocess.run([sys.executable, "-c", code, __file__], cwd=checkout, env=_env(checkout, library),
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def measure_in(checkout: str, library: str, label: str, calls: int, repeats: int) -> dict:
    """One run of `checkout`'s own benchmark, in a fresh process on its own kernel library."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        subprocess.run([sys.executable, "-m", "benchmarks.bench_hot_path", "--label", label, "--out", out,
                        "--calls", str(calls), "--repeats", str(repeats)], cwd=checkout,
                       env=_env(checkout, library), check=True, capture_output=True)
        with open(out, encoding="utf-8") as handle:
            return json.load(handle)["runs"][label]


def _env(checkout: str, library: str) -> dict:
    return dict(os.environ, SGL_SM120_EXT_LIBRARY=library, SGLANG_SM120_EXT_LIBRARY=library,
                PYTHONPATH=os.pathsep.join([os.path.join(checkout, "python"), checkout]))


def _target(text: str) -> tuple[str, float]:
    op, _, ratio = text.partition("=")
    if op not in OPS:
        raise argparse.ArgumentTypeError(f"{op!r} is not one of {', '.join(OPS)}")
    return op, float(ratio)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="after", help="this checkout's name in the JSON")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                              "hot_path_overhead_cpu.json"), help="the JSON to write")
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed sample")
    parser.add_argument("--repeats", type=int, default=9, help="timed samples; the median is reported")
    parser.add_argument("--before", metavar="CHECKOUT", help="a worktree of the earlier commit: measured in "
                        "rounds alternating with this checkout, each in a fresh process")
    parser.add_argument("--before-library", metavar="SO", help="the kernel library built from --before's sources")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds with --before")
    parser.add_argument("--target", type=_target, action="append", metavar="OP=RATIO",
                        help="the before / after ratio this comparison aims at, per op (default: 2 for both)")
    args = parser.parse_args(argv)
    if not args.before:
        run = measure_here(args.calls, args.repeats)
        plain, boundary = build()
        run["predicates"] = {"plain": predicates(plain), "fused_boundary": predicates(boundary)}
        doc = {"runs": {}}
        if os.path.exists(args.out):
            with open(args.out, encoding="utf-8") as handle:
                doc = json.load(handle)
        doc["runs"][args.label] = run
        _write(args.out, doc)
        print(f"{args.label} ({run['commit']}): plain {run['plain']['median_us']} us, fused boundary "
              f"{run['fused_boundary']['median_us']} us per call")
        return 0
    if not args.before_library:
        parser.error("--before needs --before-library")
    here = str(Path(__file__).resolve().parents[1])
    library = os.environ.get("SGLANG_SM120_EXT_LIBRARY") or os.environ.get("SGL_SM120_EXT_LIBRARY") or ""
    rounds = []
    for _ in range(args.rounds):  # alternating: a shared CPU's slow spells land on both sides alike
        before = measure_in(args.before, args.before_library, "before", args.calls, args.repeats)
        after = measure_in(here, library, "after", args.calls, args.repeats)
        rounds.append({"before": before, "after": after, "before_over_after": {
            op: round(before[op]["median_us"] / after[op]["median_us"], 2) for op in OPS}})
        print(f"before {before['commit']} / after {after['commit']}: " + ", ".join(
            f"{op} {before[op]['median_us']} / {after[op]['median_us']} us" for op in OPS), flush=True)
    targets = dict(args.target or [(op, 2.0) for op in OPS])
    comparison = {"before": rounds[0]["before"]["commit"], "after": rounds[0]["after"]["commit"],
                  "target": {op: f"before / after >= {ratio:g}" for op, ratio in targets.items()}, "rounds": rounds,
                  "before_over_after": {op: statistics.median(r["before_over_after"][op] for r in rounds)
                                        for op in OPS},
                  "predicates": {"before": predicates_in(args.before, args.before_library),
                                 "after": predicates_in(here, library)}}
    comparison["met"] = all(comparison["before_over_after"][op] >= ratio for op, ratio in targets.items())
    doc = {"benchmark": "hot_path_overhead", "what": "Python cost per eager call (us), stand-in ops, CPU",
           "statistic": "per round: the median over samples; a comparison's verdict: the median over its rounds of "
                        "before / after", "comparisons": []}
    if os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as handle:
            doc = json.load(handle)
    doc["comparisons"].append(comparison)
    _write(args.out, doc)
    print(f"before / after (median of {len(rounds)} rounds): {comparison['before_over_after']}; target met: "
          f"{comparison['met']}; predicates {comparison['predicates']}")
    return 0


OPS = ("plain", "fused_boundary")


def _write(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
        handle.write("\n")


if __name__ == "__main__":
    sys.exit(main())
