"""`python -m sglang_sm120.tune`: measure on this box which all-reduce serves each message size fastest (NCCL or
one of our kernels' launches, each checked exact first), and write the routing table this box's servers route by.

    python -m sglang_sm120.tune --model-path moonshotai/Kimi-K2.5 --max-batch 32 --draft-tokens 4
    python -m sglang_sm120.tune --hidden 7168 --tp 8 --quick

The table goes to $SGLANG_SM120_CACHE (default ~/.cache/sglang_sm120), keyed by the GPUs, driver, versions, NCCL's
settings, TP size, islands, P2P, workspace memory and launch: rerun after changing any of them.
"""

from __future__ import annotations

import argparse
import glob
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence

from .core import nccl
from .core.config import hidden_from_model
from .routing import cache, render
from .routing.table import NCCL, RoutingTable
from .tuning import processes
from .tuning.tuner import TuneSpec, graph_rows

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--model-path", help="model folder or Hugging Face repo id: its config.json's hidden_size")
    shape.add_argument("--hidden", type=int, help="hidden size (Kimi-K2.5: 7168)")
    add("--tp", type=int, help="ranks (2, 4 or 8; default: the most GPUs visible)")
    add("--gpus", help="comma list of the ranks' CUDA devices (default 0..TP-1)")
    add("--max-batch", type=int, default=32, help="largest decode/verify batch the server captures")
    add("--draft-tokens", type=int, default=4, help="speculative draft tokens per request (1: none)")
    add("--cuda-graph-bs",
        help="comma list of the batch sizes the server captures: each, and each x draft-tokens, is measured")
    add("--max-rows", type=int, help="rows to measure up to (default: max-batch x draft-tokens)")
    add("--dtype", default="bf16,fp16", help="comma list of bf16, fp16")
    add("--kinds", default="plain,fused", help="comma list of plain, fused")
    add("--quick", action="store_true", help="fewer sizes and replays (what a launch runs)")
    add("--if-missing", action="store_true",
        help="stop at once when a table of this box's key exists (what a launch runs)")
    add("--out", help="also write the table here")
    add("--retries", type=int, default=3, help="restarts after a candidate crashed or hung a rank")
    add("--timeout", type=float, default=900.0, help="seconds for one attempt")
    add("--stall", type=float, default=120.0, help="seconds without progress that count as a hang")
    add("--kernel-timeout", type=float, default=5.0,
        help="seconds a kernel waits for a peer before the candidate fails")
    add("--share-gpu", action="store_true",
        help="let ranks share the visible GPUs (plumbing checks on one GPU; the times mean nothing)")
    add("--debug-nccl-us", type=float, help=argparse.SUPPRESS)
    add("-v", "--verbose", action="store_true", help="print every candidate as it starts")
    args = parser.parse_args(argv)
    try:
        args.dtypes = list(dict.fromkeys(DTYPES[d.strip().lower()] for d in args.dtype.split(",") if d.strip()))
    except KeyError as exc:
        parser.error(f"--dtype: unknown dtype {exc.args[0]!r} (bf16, fp16)")
    args.kinds_list = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not args.kinds_list or any(k not in ("plain", "fused") for k in args.kinds_list):
        parser.error(f"--kinds {args.kinds!r}: a comma list of plain, fused")
    if args.tp is not None and args.tp not in (2, 4, 8):
        parser.error(f"--tp {args.tp}: the kernels run 2, 4 or 8 ranks")
    for name in ("max_batch", "draft_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.gpu_list = [int(g) for g in args.gpus.split(",")] if args.gpus else None
        args.graph_rows = graph_rows([int(b) for b in args.cuda_graph_bs.split(",") if b.strip()],
                                     args.draft_tokens) if args.cuda_graph_bs else []
    except ValueError as exc:
        parser.error(f"--gpus / --cuda-graph-bs: {exc}")
    return args


def plan_ranks(tp: int | None, gpus: int, share: bool, chosen: list[int] | None = None) -> tuple[int, list[int]]:
    """(world size, device of each rank)."""
    if gpus < 1:
        raise SystemExit("error: no CUDA GPU visible")
    if chosen is not None:
        tp = tp or len(chosen)
        if len(chosen) != tp or any(not 0 <= g < gpus for g in chosen):
            raise SystemExit(f"error: --gpus {chosen}: {tp} devices among the {gpus} visible")
        return tp, list(chosen)
    if tp is None:
        fitting = [w for w in (2, 4, 8) if w <= gpus] or ([2] if share else [])
        if not fitting:
            raise SystemExit(f"error: {gpus} GPU visible, the kernels need 2, 4 or 8 ranks (--share-gpu --tp 2 "
                             "for a plumbing check)")
        tp = max(fitting)
    if tp > gpus and not share:
        raise SystemExit(f"error: --tp {tp} needs {tp} GPUs, {gpus} visible (--share-gpu lets ranks share them)")
    return tp, [r % gpus for r in range(tp)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    world, devices = plan_ranks(args.tp, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                                args.share_gpu, args.gpu_list)
    hidden = args.hidden if args.hidden is not None else hidden_from_model(args.model_path)
    max_rows = args.max_rows or max([args.max_batch * args.draft_tokens] + args.graph_rows)
    spec = TuneSpec.make(hidden, max_rows, quick=args.quick, dtypes=args.dtypes, kinds=args.kinds_list,
                         kernel_timeout_s=args.kernel_timeout, debug_nccl_us=args.debug_nccl_us,
                         graph_rows=[r for r in args.graph_rows if r <= max_rows], if_missing=args.if_missing)
    print(f"tuning TP={world} on cuda:{devices}, hidden {hidden}, rows {spec.rows}, {', '.join(spec.dtypes)}, "
          f"{', '.join(spec.kinds)}{' (quick)' if spec.quick else ''}", flush=True)
    last = {}

    def on_event(rank: int, event: dict) -> None:
        if rank != 0 or event.get("event") != "begin":
            return
        where = (event["dtype"], event["kind"], event["rows"])
        if args.verbose or last.get("where") != where:
            print(f"  {event['dtype']} {event['kind']} rows {event['rows']}"
                  + (f": {event['candidate']}" if args.verbose else ""), flush=True)
        last["where"] = where

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sm120-tune-nccl-") as logs:
        # Which transport NCCL chose between each pair, from its own INFO lines, goes into the table's notes.
        env = {**processes.child_env(), **(nccl.log_env(logs, os.environ) if spec.debug_nccl_us is None else {})}
        attempt = processes.tune_with_retries(
            world, devices, spec, retries=args.retries, timeout_s=args.timeout, stall_s=args.stall, on_event=on_event,
            env=env, on_retry=lambda attempt: print(f"attempt failed: {attempt.error}; excluding "
                                                    f"{attempt.culprit['candidate']} from "
                                                    f"{attempt.culprit['from_bytes']} B and starting again",
                                                    flush=True))
        seen = nccl.parse_log("".join(pathlib.Path(f).read_text(errors="replace")
                                      for f in glob.glob(os.path.join(logs, "nccl.*.log"))))
    # Blamed candidates are kept under the key the ranks measured: no later tune runs them, no server routes to them.
    culprits = [c for c in spec.exclude + [attempt.culprit] if c and c.get("candidate") != NCCL]
    key = (attempt.table or {}).get("key") or next((o.key for o in attempt.outcomes if o.key), None)
    if culprits and key:
        path = cache.record_blames(key, culprits, time.strftime("%Y-%m-%d %H:%M:%S"))
        print(f"blamed for a crash or hang, never tuned or routed again on this box: "
              f"{', '.join(sorted({c['candidate'] for c in culprits}))} ({path})", flush=True)
    if attempt.found is not None:
        print(f"a routing table of this box exists: {attempt.found} (nothing measured)")
        return 0
    if attempt.table is None:
        print(f"tune failed: {attempt.error}", file=sys.stderr)
        for outcome in attempt.outcomes:
            if not outcome.ok and outcome.tail:
                print(f"--- rank {outcome.rank}, last lines:\n" + "\n".join(outcome.tail[-15:]), file=sys.stderr)
        return 1
    table = RoutingTable.from_dict(attempt.table)
    table.durations["total"] = round(time.monotonic() - start, 3)
    if line := nccl.transports_line(seen["pairs"], seen["nccl_version"]):
        table.notes.append(line)
    path = cache.save(table)
    if args.out:
        cache.save(table, path=args.out)
    print(render.table_markdown(table, path=path))
    print(f"\nwritten to {path}{f' and {args.out}' if args.out else ''}; measuring took "
          f"{table.durations.get('measure', 0):.1f} s, the whole tune {table.durations['total']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
