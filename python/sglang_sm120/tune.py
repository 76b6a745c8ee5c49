"""`python -m sglang_sm120.tune`: measure, on this box, which all-reduce serves each message size fastest (NCCL or
one of our kernels' launches), and write the routing table servers on this box route by. The only code that
measures; a launch with --sm120-allreduce-tune auto runs it when no table of this box exists (hooks/startup.py).

    python -m sglang_sm120.tune --model-path moonshotai/Kimi-K2.5 --max-batch 32 --draft-tokens 4
    python -m sglang_sm120.tune --hidden 7168 --tp 8 --quick

One process per rank (GPUs --gpus, default 0..N-1); every candidate and NCCL (for the fused op: NCCL + SGLang's
own add + RMSNorm) timed at rows 1..max-batch x draft-tokens of the hidden size, each checked exact first; the
table goes to $SGLANG_SM120_CACHE (default ~/.cache/sglang_sm120), keyed by the GPUs, driver, versions, NCCL's
settings, TP size, islands, P2P, workspace memory and launch. A candidate that crashes or hangs its rank is
blamed, excluded and the tune starts again (--retries). Rerun after changing any part of the key.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from .core.config import hidden_from_model
from .routing import cache, render
from .routing.table import NCCL, RoutingTable
from .tuning import processes
from .tuning.tuner import TuneSpec, graph_rows

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
def parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--model-path", help="model folder or Hugging Face repo id: its config.json's hidden_size")
    shape.add_argument("--hidden", type=int, help="hidden size (Kimi-K2.5: 7168)")
    parser.add_argument("--tp", type=int, default=None, help="ranks (2, 4 or 8; default: the most GPUs visible)")
    parser.add_argument("--gpus", default=None, help="comma list of the ranks' CUDA devices (default 0..TP-1)")
    parser.add_argument("--max-batch", type=int, default=32, help="largest decode/verify batch the server captures")
    parser.add_argument("--draft-tokens", type=int, default=4, help="speculative draft tokens per request (1: none)")
    parser.add_argument("--cuda-graph-bs", default=None,
                        help="comma list of the batch sizes the server captures: each, and each x draft-tokens, is "
                             "measured")
    parser.add_argument("--max-rows", type=int, default=None, help="rows to measure up to (default: max-batch x "
                                                                   "draft-tokens)")
    parser.add_argument("--dtype", default="bf16,fp16", help="comma list of bf16, fp16")
    parser.add_argument("--kinds", default="plain,fused", help="comma list of plain, fused")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and replays (what a launch runs)")
    parser.add_argument("--if-missing", action="store_true",
                        help="stop at once when a table of this box's key exists (what a launch runs)")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--retries", type=int, default=3, help="restarts after a candidate crashed or hung a rank")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one attempt")
    parser.add_argument("--stall", type=float, default=120.0, help="seconds without progress that count as a hang")
    parser.add_argument("--kernel-timeout", type=float, default=5.0,
                        help="seconds a kernel waits for a peer before the candidate fails")
    parser.add_argument("--share-gpu", action="store_true",
                        help="let ranks share the visible GPUs (plumbing checks on one GPU; the times mean nothing)")
    parser.add_argument("--debug-nccl-us", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every candidate as it starts")
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

    def on_retry(attempt) -> None:
        print(f"attempt failed: {attempt.error}; excluding {attempt.culprit['candidate']} from "
              f"{attempt.culprit['from_bytes']} B and starting again", flush=True)

    start = time.monotonic()
    attempt = processes.tune_with_retries(world, devices, spec, retries=args.retries, timeout_s=args.timeout,
                                          stall_s=args.stall, on_event=on_event, on_retry=on_retry)
    remember_blames(attempt, spec)
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
    path = cache.save(table)
    if args.out:
        cache.save(table, path=args.out)
    print(render.table_markdown(table, path=path))
    print(f"\nwritten to {path}{f' and {args.out}' if args.out else ''}; measuring took "
          f"{table.durations.get('measure', 0):.1f} s, the whole tune {table.durations['total']:.1f} s")
    return 0


def remember_blames(attempt: processes.Attempt, spec: TuneSpec) -> str | None:
    """Keep the candidates this tune blamed for a crash or hang in the cache under the key the ranks measured, so
    no later tune runs them and no server routes to them. Returns the file written, or None."""
    culprits = [c for c in list(spec.exclude) + [attempt.culprit] if c and c.get("candidate") != NCCL]
    key = (attempt.table or {}).get("key") or next((o.key for o in attempt.outcomes if o.key), None)
    if not culprits or not key:
        return None
    path = cache.record_blames(key, culprits, time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"blamed for a crash or hang, never tuned or routed again on this box: "
          f"{', '.join(sorted({c['candidate'] for c in culprits}))} ({path})", flush=True)
    return path


if __name__ == "__main__":
    sys.exit(main())
