"""How long a server's first launch tunes: the launcher's exact quick tune (hooks/startup.py's command for README's
Kimi-K2.5 + EAGLE-3 launch, SGLang 0.5.23's default decode capture sizes), from its start to its table, per phase.

    python -m benchmarks.bench_tune                       # -> benchmarks/results/tune_duration_<gpu>.json
    python -m benchmarks.bench_tune --tp 2,8 --processes-tp 2 --full-tp 0

On one GPU, in two modes, each in fresh processes and a fresh cache (no cluster verdict, no table: a first launch):
- one process (benchmarks/harness/local_tune.py): the W ranks as workspaces of one GPU whose kernels run at once, as
  on W GPUs, each on a W-th of the SMs; its phases: torch and CUDA, the cluster check, the workspaces, measuring;
- processes sharing the GPU (`python -m sglang_sm120.tune --share-gpu`, the launcher's own tool): process start,
  CUDA, the cluster check, the process group, workspace and data-path probe, measuring. Ranks sharing a GPU as
  processes time-slice it, so each call of ours waits a time slice for its peer: the JSON gives the calls made.
NCCL cannot run either way (two ranks on one GPU; a group in one process): its time is injected at --nccl-us, 1 s by
default, so no candidate is pruned and every pair of the spec is measured: the most work the spec can take.
The full tune (every candidate profiled at every size of its denser ladder) runs once, one process, at --full-tp.
A run cut off at --timeout is listed under failures with the end of its output: a one-process run prints each size
as it starts it ("size i of n"), so the JSON says how far it got.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

from benchmarks.harness import io

HIDDEN = 7168  # Kimi-K2.5
DRAFT_TOKENS = 4  # README's launch: --speculative-num-draft-tokens 4
PHASE_ORDER = ("start", "torch and CUDA", "cluster check", "process group", "workspace and probe", "workspace",
               "measure")


def capture_sizes(max_bs: int) -> list[int]:
    """SGLang 0.5.23's decode capture sizes with speculative decoding: every size to 8, then steps of 2 to 32, of 4
    to 64, of 8 to 256 and of 16 above, and max_bs itself."""
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def default_max_bs(tp: int) -> int:
    """SGLang 0.5.23's default decode max batch on a GPU of 90-160 GB (an RTX PRO 6000 has 96 GB): 512 from TP 4."""
    return 512 if tp >= 4 else 256


def launcher_args(tp: int) -> list[str]:
    """The tool's arguments the launcher passes for README's launch at this TP size (first launch: no table)."""
    from sglang_sm120.core.config import OverlaySettings
    from sglang_sm120.hooks.startup import tune_command

    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w", encoding="utf-8") as handle:
            json.dump({"text_config": {"hidden_size": HIDDEN}}, handle)
        max_bs = default_max_bs(tp)
        server_args = SimpleNamespace(
            model_path=model, tp_size=tp, nnodes=1, base_gpu_id=0, gpu_id_step=1, dtype="auto",
            speculative_algorithm="EAGLE3", speculative_num_draft_tokens=DRAFT_TOKENS,
            cuda_graph_bs=capture_sizes(max_bs), cuda_graph_max_bs=max_bs)
        command = tune_command(server_args, OverlaySettings(mode="on"))
    return [a for a in command[3:] if a != "--if-missing"]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def run(command: list[str], env: dict, timeout_s: float) -> tuple[float, int, str]:
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        return time.monotonic() - start, done.returncode, (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:  # its output so far, as bytes whatever `text` says
        said = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return time.monotonic() - start, -1, f"cut at {timeout_s:.0f} s: {said[-2000:]}"


def summary(table_file: str, wall_s: float) -> dict:
    """What one run did: its wall, its phases (the table's durations; the rest of the wall is process start and
    imports), the candidate x size pairs, and the slowest phase."""
    with open(table_file, encoding="utf-8") as handle:
        doc = json.load(handle)
    durations = {k: float(v) for k, v in doc["durations"].items() if k != "total"}
    inside = float(doc["durations"].get("total", wall_s))
    phases = {"process start and imports": round(max(0.0, wall_s - inside), 3), **durations}
    pruned = sum(1 for m in doc["measurements"] for why in m["failed"].values() if why.startswith("pruned"))
    pairs = dict(doc["workload"].get("pairs") or {})
    return {"wall_s": round(wall_s, 3), "phases_s": phases, "slowest_phase": max(phases, key=phases.get),
            "sizes": len(doc["workload"]["rows"]), "rows": doc["workload"]["rows"],
            "pairs": {**pairs, "pruned": pruned},
            "calls_of_ours": (pairs.get("ranked", 0) * doc["spec"]["burst"] + pairs.get("profiled", 0) *
                              (doc["spec"]["burst"] + doc["spec"]["warmup"] + doc["spec"]["iters"]))
            * doc["spec"]["calls"] if "spec" in doc else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="2,4,8", help="one-process group sizes")
    parser.add_argument("--processes-tp", type=int, default=2, help="processes sharing the GPU (0: skip)")
    parser.add_argument("--full-tp", type=int, default=8, help="the full tune, one process (0: skip)")
    parser.add_argument("--nccl-us", type=float, default=1e6, help="NCCL's injected time")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one run")
    parser.add_argument("--out", help="the JSON (default benchmarks/results/tune_duration_<gpu>.json)")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.harness.hardware import hardware_info
    from sglang_sm120.tuning.tuner import TuneSpec

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    runs, failures = [], []
    with tempfile.TemporaryDirectory(prefix="sm120-bench-tune-") as work:
        def one(label: str, tp: int, mode: str, command: list[str], table_file: str, spec_args: list[str]) -> None:
            run_env = dict(env, SGLANG_SM120_CACHE=os.path.join(work, f"cache-{label}"))  # a first launch
            wall, code, tail = run(command, run_env, args.timeout)
            print(f"{label}: exit {code} after {wall:.1f} s", flush=True)
            if code != 0 or not os.path.exists(table_file):
                failures.append({"run": label, "exit_code": code, "wall_s": round(wall, 3), "tail": tail})
                return
            with open(table_file, encoding="utf-8") as handle:
                doc = json.load(handle)
            quick = "--quick" in spec_args
            spec = TuneSpec.make(HIDDEN, 1, quick=quick)
            doc["spec"] = {"calls": spec.calls, "burst": spec.burst, "warmup": spec.warmup, "iters": spec.iters}
            with open(table_file, "w", encoding="utf-8") as handle:
                json.dump(doc, handle)
            runs.append({"run": label, "mode": mode, "tp": tp, "quick": quick, "command": " ".join(spec_args),
                         **summary(table_file, wall)})

        for tp in [int(t) for t in args.tp.split(",") if t.strip()]:
            spec_args = launcher_args(tp)
            table_file = os.path.join(work, f"one_process_tp{tp}.json")
            local = [sys.executable, "-m", "benchmarks.harness.local_tune", "--tp", str(tp),
                     "--hidden", option(spec_args, "--hidden"), "--max-rows", option(spec_args, "--max-rows"),
                     "--cuda-graph-bs", option(spec_args, "--cuda-graph-bs"),
                     "--draft-tokens", option(spec_args, "--draft-tokens"), "--dtype", "bfloat16",
                     "--debug-nccl-us", str(args.nccl_us), "--out", table_file]
            one(f"one_process_tp{tp}", tp, "one process, ranks concurrent", local, table_file, spec_args)
        if args.processes_tp:
            tp, spec_args = args.processes_tp, launcher_args(args.processes_tp)
            table_file = os.path.join(work, f"processes_tp{tp}.json")
            command = [sys.executable, "-m", "sglang_sm120.tune", *spec_args, "--share-gpu", "--gpus",
                       ",".join(["0"] * tp), "--debug-nccl-us", str(args.nccl_us), "--out", table_file,
                       "--timeout", str(args.timeout)]
            one(f"processes_tp{tp}", tp, "processes sharing the GPU (time-sliced)", command, table_file, spec_args)
        if args.full_tp:
            tp, spec_args = args.full_tp, launcher_args(args.full_tp)
            table_file = os.path.join(work, f"full_one_process_tp{tp}.json")
            local = [sys.executable, "-m", "benchmarks.harness.local_tune", "--tp", str(tp), "--full",
                     "--hidden", option(spec_args, "--hidden"), "--max-rows", option(spec_args, "--max-rows"),
                     "--cuda-graph-bs", option(spec_args, "--cuda-graph-bs"),
                     "--draft-tokens", option(spec_args, "--draft-tokens"), "--dtype", "bfloat16",
                     "--debug-nccl-us", str(args.nccl_us), "--out", table_file]
            one(f"full_one_process_tp{tp}", tp, "one process, ranks concurrent (full tune)", local, table_file,
                [a for a in spec_args if a != "--quick"])
    gpu = io.gpu_slug(torch.cuda.get_device_name(0))
    doc = {"benchmark": "bench_tune", "hardware": hardware_info(), "nccl_injected_us": args.nccl_us,
           "launch": {"hidden": HIDDEN, "draft_tokens": DRAFT_TOKENS, "dtype": "bfloat16",
                      "capture_sizes_by_tp": {str(r["tp"]): capture_sizes(default_max_bs(r["tp"])) for r in runs}},
           "targets_s": {"2": 10.0, "8": 20.0}, "runs": runs, "failures": failures}
    out = args.out or str(io.RESULTS_DIR / f"tune_duration_{gpu}.json")
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=1)
    for r in runs:
        print(f"{r['run']}: {r['wall_s']:.1f} s, {r['sizes']} sizes, pairs {r['pairs']}, slowest phase "
              f"{r['slowest_phase']} ({r['phases_s'][r['slowest_phase']]:.1f} s)")
    print(f"written to {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
