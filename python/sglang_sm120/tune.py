"""`python -m sglang_sm120.tune`: measure, on this box, which all-reduce serves each message size fastest (NCCL or
one of our kernels' configurations), and write the routing table that servers on this box then route by.

    python -m sglang_sm120.tune --model-path moonshotai/Kimi-K2.5 --max-batch 32 --draft-tokens 4
    python -m sglang_sm120.tune --hidden 7168 --tp 8 --quick

It starts one process per rank itself (GPUs 0..N-1; --tp N, default the largest of 2/4/8 GPUs visible), times
every eligible candidate and NCCL (for the fused op: NCCL + SGLang's own add + RMSNorm) at rows 1..max-batch x
draft-tokens of the model's hidden size, bf16 and fp16, plain and fused, each checked exact first, and writes
the table to $SGLANG_SM120_CACHE (default ~/.cache/sglang_sm120). A candidate that crashes or hangs its rank is
excluded and the tune starts again (--retries). A server finds the table by its key (GPUs, driver, versions,
TP size, islands, P2P, workspace memory); rerun after changing any of those, or GPU placement.

Ran on 1x H200 (2 ranks sharing it, NCCL's time injected), 2026-12-02: tests/gpu/test_tune_gpu.py. Never on
several GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from .reporting import render
from .routing import cache
from .routing.table import NCCL, RoutingTable
from .tuning import launch
from .tuning.tuner import TuneSpec, graph_rows

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
HIDDEN_KEYS = ("text_config", "language_config", "llm_config", "language_model")


def hidden_from_config(config: dict) -> int | None:
    """hidden_size of a HF config.json, at the top or in the text model's section (multimodal models)."""
    if isinstance(config.get("hidden_size"), int):
        return int(config["hidden_size"])
    for key in HIDDEN_KEYS:
        sub = config.get(key)
        if isinstance(sub, dict) and isinstance(sub.get("hidden_size"), int):
            return int(sub["hidden_size"])
    return None


def hidden_from_model(model_path: str) -> int:
    """The hidden size of a local model folder, or of a Hugging Face repo id (its config.json, fetched or cached)."""
    if os.path.isdir(model_path):
        path = os.path.join(model_path, "config.json")
    else:
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model_path, "config.json")
        except Exception as exc:
            raise SystemExit(f"error: cannot read config.json of {model_path!r} ({type(exc).__name__}: {exc}); "
                             "pass --hidden") from None
    try:
        with open(path, encoding="utf-8") as handle:
            hidden = hidden_from_config(json.load(handle))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read {path} ({exc}); pass --hidden") from None
    if hidden is None:
        raise SystemExit(f"error: {path} names no hidden_size; pass --hidden")
    return hidden


def parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    shape = parser.add_mutually_exclusive_group(required=True)
    shape.add_argument("--model-path", help="model folder or Hugging Face repo id: its config.json's hidden_size")
    shape.add_argument("--hidden", type=int, help="hidden size (Kimi-K2.5: 7168)")
    parser.add_argument("--tp", type=int, default=None, help="ranks (2, 4 or 8; default: the most GPUs visible)")
    parser.add_argument("--max-batch", type=int, default=32, help="largest decode/verify batch the server captures")
    parser.add_argument("--draft-tokens", type=int, default=4, help="speculative draft tokens per request (1: none)")
    parser.add_argument("--cuda-graph-bs", default=None,
                        help="comma list of the batch sizes the server captures in CUDA graphs: each, and each x "
                             "draft-tokens, is measured (what the start-up tune does)")
    parser.add_argument("--max-rows", type=int, default=None, help="rows to measure up to (default: max-batch x "
                                                                   "draft-tokens)")
    parser.add_argument("--dtype", default="bf16,fp16", help="comma list of bf16, fp16")
    parser.add_argument("--kinds", default="plain,fused", help="comma list of plain, fused")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and replays (what a server start runs)")
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--retries", type=int, default=3, help="restarts after a candidate crashed or hung a rank")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one attempt")
    parser.add_argument("--stall", type=float, default=120.0, help="seconds without progress that count as a hang")
    parser.add_argument("--kernel-timeout", type=float, default=5.0,
                        help="seconds a kernel waits for a peer before the candidate fails")
    parser.add_argument("--share-gpu", action="store_true",
                        help="let ranks share the visible GPUs (plumbing checks on a one-GPU machine; times are "
                             "meaningless)")
    parser.add_argument("--debug-nccl-us", type=float, default=None, help=argparse.SUPPRESS)
    # Plumbing check on one GPU with the ranks running concurrently (tuning/measure_local.py); needs
    # --debug-nccl-us, writes --out only (never the cache).
    parser.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
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
    if args.one_process and args.debug_nccl_us is None:
        parser.error("--one-process needs --debug-nccl-us US: NCCL cannot run a group inside one process")
    for name in ("max_batch", "draft_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.graph_rows = []
    if args.cuda_graph_bs:
        try:
            args.graph_rows = graph_rows([int(b) for b in args.cuda_graph_bs.split(",") if b.strip()],
                                         args.draft_tokens)
        except ValueError as exc:
            parser.error(f"--cuda-graph-bs {args.cuda_graph_bs!r}: {exc}")
    return args


def plan_ranks(tp: int | None, gpus: int, share: bool) -> tuple[int, list[int]]:
    """(world size, device of each rank)."""
    if gpus < 1:
        raise SystemExit("error: no CUDA GPU visible")
    if tp is None:
        fitting = [w for w in (2, 4, 8) if w <= gpus]
        if not fitting:
            if not share:
                raise SystemExit(f"error: {gpus} GPU visible, the kernels need 2, 4 or 8 ranks (--share-gpu --tp 2 "
                                 "for a plumbing check)")
            fitting = [2]
        tp = max(fitting)
    if tp > gpus and not share:
        raise SystemExit(f"error: --tp {tp} needs {tp} GPUs, {gpus} visible (--share-gpu lets ranks share them)")
    return tp, [r % gpus for r in range(tp)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    world, devices = plan_ranks(args.tp, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                                args.share_gpu or args.one_process)
    if args.one_process:
        devices = [devices[0]] * world
    hidden = args.hidden if args.hidden is not None else hidden_from_model(args.model_path)
    max_rows = args.max_rows or max([args.max_batch * args.draft_tokens] + args.graph_rows)
    spec = TuneSpec.make(hidden, max_rows, quick=args.quick, dtypes=args.dtypes, kinds=args.kinds_list,
                         kernel_timeout_s=args.kernel_timeout, debug_nccl_us=args.debug_nccl_us,
                         graph_rows=args.graph_rows)
    print(f"tuning TP={world} on cuda:{devices}, hidden {hidden}, rows {spec.rows}, {', '.join(spec.dtypes)}, "
          f"{', '.join(spec.kinds)}{' (quick)' if spec.quick else ''}", flush=True)
    last = {}

    def on_event(rank: int, event: dict) -> None:
        if rank != 0 or event.get("event") != "begin":
            return
        where = (event["dtype"], event["kind"], event["rows"])
        if args.verbose:
            print(f"  {event['dtype']} {event['kind']} rows {event['rows']}: {event['candidate']}", flush=True)
        elif last.get("where") != where:
            print(f"  {event['dtype']} {event['kind']} rows {event['rows']}", flush=True)
        last["where"] = where

    def on_retry(attempt) -> None:
        print(f"attempt failed: {attempt.error}; excluding {attempt.culprit['candidate']} from "
              f"{attempt.culprit['from_bytes']} B and starting again", flush=True)

    start = time.monotonic()
    if args.one_process:
        return _one_process(world, devices[0], spec, args.out, start)
    attempt = launch.tune_with_retries(world, devices, spec, retries=args.retries, timeout_s=args.timeout,
                                       stall_s=args.stall, on_event=on_event, on_retry=on_retry)
    remember_blames(attempt, spec)
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
    copies = f"{path}" + (f" and {args.out}" if args.out else "")
    print(f"\nwritten to {copies}; measuring took {table.durations.get('measure', 0):.1f} s, the whole tune "
          f"{table.durations['total']:.1f} s")
    return 0


def remember_blames(attempt: launch.Attempt, spec: TuneSpec) -> str | None:
    """Keep the candidates this tune blamed for a crash or hang (its exclusions, and the last attempt's culprit)
    in the cache under the key the children measured, so that no later tune runs them and no server routes to
    them (routing/cache.py). Returns the file written, or None."""
    culprits = [c for c in list(spec.exclude) + [attempt.culprit] if c and c.get("candidate") != NCCL]
    key = (attempt.table or {}).get("key") or next((o.key for o in attempt.outcomes if o.key), None)
    if not culprits or not key:
        return None
    path = cache.record_blames(key, culprits, time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"blamed for a crash or hang, never tuned or routed again on this box: "
          f"{', '.join(sorted({c['candidate'] for c in culprits}))} ({path})", flush=True)
    return path


def _one_process(world: int, device: int, spec: TuneSpec, out: str | None, start: float) -> int:
    from .tuning.measure_local import run_one_process

    table, _ = run_one_process(world, device, spec)
    table.durations["total"] = round(time.monotonic() - start, 3)
    if out:
        cache.save(table, path=out)
    print(render.table_markdown(table, path=out))
    print(f"\none process, {world} ranks on cuda:{device}: a plumbing check, not put in the cache"
          f"{f'; written to {out}' if out else ''}; measuring took {table.durations.get('measure', 0):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
