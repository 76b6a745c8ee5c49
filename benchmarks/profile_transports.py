"""Targets for Nsight Compute on the transports' speed misses: one loopback call configuration per process, so that
`ncu` profiles exactly that kernel (scripts/gpu_suite.sh, stage profile-transports, runs every case under ncu).

    python -m benchmarks.profile_transports --list
    ncu --clock-control none --kernel-name regex:"all_reduce|rmsnorm" --launch-skip 5 --launch-count 1 \
        --set full -o report python -m benchmarks.profile_transports --case w8_fused_push_r3

The misses, at bf16 [3, 7168] in the loopback benchmark (benchmarks/bench_transports.py): the fused one-shot at
W = 8 (target <= 3.0 us), and staged push and pull at W = 2 (target: within 10% of push). A case runs WARMUP + 1
calls, each after the loopback refill (its kernel, fill_ready_kernel, does not match the filter above), so the
profiled launch is the (WARMUP + 1)-th all-reduce kernel, with the same launch as the benchmark's default config:
every transport on the whole SM budget, the fused cluster by the kernels' own rule. The result is checked (every source
holds 1.0, so the sum is W, plus the residual's 1.0 when fused); a wrong one exits 1.
"""

from __future__ import annotations

import argparse
import sys

WARMUP = 5  # scripts/gpu_suite.sh's ncu --launch-skip
HIDDEN = 7168  # benchmarks.bench_transports.HIDDEN
ROWS = 3
# name: (world, op, transport)
CASES = {
    f"w{world}_{'fused' if op == 'all_reduce_add_rmsnorm' else 'plain'}_{transport}_r{ROWS}": (world, op, transport)
    for world, op, transport in [
        (8, "all_reduce", "push"),
        (8, "all_reduce_add_rmsnorm", "push"),
        (8, "all_reduce_add_rmsnorm", "pull"),
        (2, "all_reduce", "push"),
        (2, "all_reduce", "staged"),
        (2, "all_reduce", "pull"),
        (2, "all_reduce_add_rmsnorm", "push"),
        (2, "all_reduce_add_rmsnorm", "staged"),
        (2, "all_reduce_add_rmsnorm", "pull"),
    ]
}


def run_case(name: str) -> bool:
    import torch

    from benchmarks.bench_transports import LoopbackCall, default_blocks
    from sgl_kernel_sm120 import _ext

    world, op, transport = CASES[name]
    ops = _ext.ops()
    dev = torch.device("cuda", torch.cuda.current_device())
    ws = ops.ws_create_loopback(dev.index, world, ROWS * HIDDEN)
    try:
        blocks = default_blocks(transport, int(ops.ws_sm_count(ws)))
        call = LoopbackCall(ops, ws, world, ROWS, dev, 0, transport, op, blocks)
        for _ in range(WARMUP + 1):
            call()
        torch.cuda.synchronize()
        correct = call.one_shot_correct()
        print(f"{name}: W={world} {op} [{ROWS},{HIDDEN}] {transport} on {blocks} CTAs: "
              f"{'correct' if correct else 'WRONG RESULT'}", flush=True)
        return correct
    finally:
        ops.ws_destroy(ws)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true", help="print the case names, one per line")
    g.add_argument("--case", choices=sorted(CASES), help="the case to profile (under Nsight Compute)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    return 0 if run_case(args.case) else 1


if __name__ == "__main__":
    raise SystemExit(main())
