"""`python -m sglang_sm120.tune`: measure on this box which all-reduce serves each message size fastest (NCCL or
one of our kernels' launches, each checked exact first), and write the routing table this box's servers route by.

    python -m sglang_sm120.tune --model-path moonshotai/Kimi-K2.5 --max-batch 32 --draft-tokens 4
    python -m sglang_sm120.tune --hidden 7168 --tp 8 --quick

The table goes to $SGLANG_SM120_CACHE (default ~/.cache/sglang_sm120), keyed by the GPUs, driver, versions, NCCL's
settings, TP size, islands, P2P, workspace memory and launch: rerun after changing any of them. A failed tune leaves a
note there that a launch does not retry past (--sm120-allreduce-tune force does); one tune of a set of GPUs runs at a
time (a lock there).
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

from . import seams
from .core import nccl
from .core.config import hidden_from_model
from .core.gate import SUPPORTED_WORLD_SIZES
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
        help="stop at once, before any GPU process starts, when a table of this box covering these sizes exists, or "
             "a tune of it failed before (what a launch runs)")
    add("--server-env", action="store_true",
        help="the environment is the server's (what a launch passes): set none of the NCCL_* variables an SGLang "
             "server sets (by default they are set as a server would, so that it finds this table)")
    add("--out", help="also write the table here")
    add("--retries", type=int, default=3, help="restarts after a candidate crashed or hung a rank")
    add("--timeout", type=float, default=900.0, help="seconds for the whole run, every attempt included")
    add("--stall", type=float, default=60.0, help="seconds without progress that count as a hang")
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
    if args.tp is not None and args.tp not in SUPPORTED_WORLD_SIZES:
        parser.error(f"--tp {args.tp}: the kernels run {', '.join(map(str, SUPPORTED_WORLD_SIZES))} ranks")
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
        fitting = [w for w in SUPPORTED_WORLD_SIZES if w <= gpus] or ([min(SUPPORTED_WORLD_SIZES)] if share else [])
        if not fitting:
            raise SystemExit(f"error: {gpus} GPU visible, the kernels need 2, 4 or 8 ranks (--share-gpu --tp 2 "
                             "for a plumbing check)")
        tp = max(fitting)
    if tp > gpus and not share:
        raise SystemExit(f"error: --tp {tp} needs {tp} GPUs, {gpus} visible (--share-gpu lets ranks share them)")
    return tp, [r % gpus for r in range(tp)]


PHASES = (("start", "start"), ("cuda", "torch and CUDA"), ("clusters", "cluster check"), ("group", "process group"),
          ("workspace", "workspace and probe"))


def phase_durations(outcomes) -> dict[str, float]:
    """Seconds of each start-up phase of the slowest rank (spawn to its first line, to its CUDA context, ...)."""
    out, previous = {}, 0.0
    for event, name in PHASES:
        ends = [o.phases[event] for o in outcomes if event in o.phases]
        if len(ends) == len(outcomes) and ends:
            out[name] = round(max(ends) - previous, 3)
            previous = max(ends)
    return out


# The parts of tuning/processes.planned, as a launch that does not reuse a table names them.
PLANNED_PARTS = {"facts": "the GPUs, driver, CUDA, torch, NCCL or kernel library",
                 "nccl": "the NCCL_* settings (SGLang 0.5.23 sets NCCL_GRAPH_REGISTER=0 when it captures CUDA graphs)",
                 "p2p": "P2P between the GPUs", "plan": "the planned workspace",
                 "switches": "the kernel launch switches", "pdl": "PDL", "verdicts": "the cluster-check verdicts"}


def existing_table(path: str, planned_digest: str, spec: TuneSpec) -> tuple[str | None, str]:
    """(`path` when the table there serves this launch: a table of this box, tuned under what the tool sees now,
    that measured every dtype, kind and captured size asked for; else None and why not, "" when there is none)."""
    found = cache.load_file(path)
    if found.status == cache.MISSING:
        return None, ""
    if not found.ok:
        return None, found.describe()
    if found.table.planned != planned_digest:
        before, now = (dict(part.split("=", 1) for part in d.split() if "=" in part)
                       for d in (found.table.planned, planned_digest))
        changed = [words for part, words in PLANNED_PARTS.items() if before.get(part) != now.get(part)]
        return None, f"it was tuned under other facts of this box ({', '.join(changed) or 'an older record'})"
    measured = set(found.table.workload.get("rows") or [])
    gaps = [gap for dtype in spec.dtypes if (gap := found.table.coverage_gap(dtype, spec.hidden, spec.kinds))]
    wanted = set(spec.graph_rows) | ({spec.max_rows} if max(measured, default=0) < spec.max_rows else set())
    missing = sorted(wanted - measured)
    if gaps or missing:
        return None, "; ".join(gaps + ([f"it did not measure rows {missing}"] if missing else []))
    return path, ""


def main(argv: Sequence[str] | None = None) -> int:
    start = time.monotonic()
    args = parse_args(argv)
    deadline = start + args.timeout
    import torch

    from .core import config
    from .core.plan import PlanRefused

    world, devices = plan_ranks(args.tp, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                                args.share_gpu, args.gpu_list)
    hidden = args.hidden if args.hidden is not None else hidden_from_model(args.model_path)
    max_rows = args.max_rows or max([args.max_batch * args.draft_tokens] + args.graph_rows)
    spec = TuneSpec.make(hidden, max_rows, quick=args.quick, dtypes=args.dtypes, kinds=args.kinds_list,
                         kernel_timeout_s=args.kernel_timeout, debug_nccl_us=args.debug_nccl_us,
                         graph_rows=[r for r in args.graph_rows if r <= max_rows])
    if problem := cache.writable():
        raise SystemExit(f"error: {problem}")
    if not args.server_env:  # run by hand: NCCL as the server will run it, the key the server will compute
        release, unset = seams.set_server_nccl()
        if unset:
            print(f"NCCL measured as an SGLang {release} server runs it: {unset} (its launcher sets them; set them "
                  "to measure another setting)", flush=True)
    hostmem = config.settings_from_environment().hostmem
    try:
        planned_digest, box = processes.planned(devices, hostmem)
    except PlanRefused as exc:
        print(f"nothing of ours to tune: {exc}", file=sys.stderr)
        return 1
    path = cache.table_path(box, hidden)
    retry = f"python -m sglang_sm120.tune --tp {world} --hidden {hidden} (or --sm120-allreduce-tune force)"
    if args.if_missing:
        found, why = existing_table(path, planned_digest, spec)
        if found:
            print(f"a routing table of this box exists: {found} (nothing measured)")
            return 0
        if why:
            print(f"not using the routing table at {path}: {why}; measuring again", flush=True)
    if args.if_missing and (note := cache.failure(box, hidden, planned=planned_digest)):
        print(f"not tuning again: {cache.describe_failure(note)}")
        return 0
    with cache.tune_lock(box, wait_s=deadline - time.monotonic()) as held:
        if not held:
            print(f"another tune of these GPUs held {path}'s lock for the whole {args.timeout:.0f} s; going on "
                  "without measuring", file=sys.stderr)
            return 1
        if args.if_missing and (found := existing_table(path, planned_digest, spec)[0]):  # the other tune's
            print(f"a routing table of this box exists: {found} (written by another launch's tune)")
            return 0
        return _tune(args, world, devices, spec, hostmem, box, path, retry, start, deadline)


def _tune(args, world, devices, spec, hostmem, box, path, retry, start, deadline) -> int:
    print(f"tuning TP={world} on cuda:{devices}, hidden {spec.hidden}, rows {spec.rows}, {', '.join(spec.dtypes)}, "
          f"{', '.join(spec.kinds)}{' (quick)' if spec.quick else ''}", flush=True)
    last = {}

    def on_event(rank: int, event: dict) -> None:
        if rank != 0 or event.get("event") != "begin":
            return
        where = (event["dtype"], event["kind"], event["rows"])
        if args.verbose or last.get("where") != where:
            print(f"  {event['dtype']} {event['kind']} rows {event['rows']}"
                  + (f": {event['pass']} {event['candidate']}" if args.verbose else ""), flush=True)
        last["where"] = where

    def on_attempt(attempt: processes.Attempt) -> None:
        """A candidate that killed or hung a rank is blamed under the key the ranks measured, as the attempt ends:
        no later tune runs it, no server routes to it."""
        key = next((o.key for o in attempt.outcomes if o.key), None)
        if attempt.culprit and attempt.culprit.get("candidate") != NCCL and key:
            where = cache.record_blames(key, [attempt.culprit], time.strftime("%Y-%m-%d %H:%M:%S"))
            print(f"attempt failed: {attempt.error}; {attempt.culprit['candidate']} is blamed from "
                  f"{attempt.culprit['from_bytes']} B on and never tuned or routed again on this box ({where})",
                  flush=True)
        elif attempt.retry:
            print(f"attempt failed: {attempt.error}; starting again", flush=True)

    with tempfile.TemporaryDirectory(prefix="sm120-tune-nccl-") as logs:
        # Which transport NCCL chose between each pair, from its own INFO lines, goes into the table's notes.
        env = {**processes.child_env(), **(nccl.log_env(logs, os.environ) if spec.debug_nccl_us is None else {})}
        attempt = processes.tune_with_retries(
            world, devices, spec, retries=args.retries, deadline=deadline, stall_s=min(args.stall, args.timeout),
            on_event=on_event, on_attempt=on_attempt, env=env)
        seen = nccl.parse_log("".join(pathlib.Path(f).read_text(errors="replace")
                                      for f in glob.glob(os.path.join(logs, "nccl.*.log"))))
    # What the tool sees, after the ranks' cluster checks cached their verdicts (part of the digest): the digest a
    # later launch computes, so that it finds this table (or this failure) instead of tuning again.
    planned_digest = processes.planned(devices, hostmem)[0]
    if attempt.table is None:
        note = cache.record_failure(box, spec.hidden, attempt.error or "unknown", retry, planned=planned_digest)
        print(f"tune failed: {attempt.error}\nnot repeated at launch ({note}); retry: {retry}", file=sys.stderr)
        for outcome in attempt.outcomes:
            if not outcome.ok and outcome.tail:
                print(f"--- rank {outcome.rank}, last lines:\n" + "\n".join(outcome.tail[-15:]), file=sys.stderr)
        return 1
    table = RoutingTable.from_dict(attempt.table)
    table.planned = planned_digest
    table.durations.update(phase_durations(attempt.outcomes))
    table.durations["total"] = round(time.monotonic() - start, 3)
    if line := nccl.transports_line(seen["pairs"], seen["nccl_version"]):
        table.notes.append(line)
    path = cache.save(table)
    cache.clear_failure(box, spec.hidden)
    if args.out:
        cache.save(table, path=args.out)
    print(render.table_markdown(table, path=path))
    print(f"\nwritten to {path}{f' and {args.out}' if args.out else ''}; measuring took "
          f"{table.durations.get('measure', 0):.1f} s, the whole tune {table.durations['total']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
