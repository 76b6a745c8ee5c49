"""The one-GPU microbenchmarks' common frame (bench_transports, bench_tuner_pick): the result
document's head and the entry point that writes `<kind>_<gpu>_<mode>.json` and fails on a wrong result."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from . import io

# Untimed replays of every graph before its timed ones: the first launches of a graph pay for its upload.
WARMUP_REPLAYS = 3
# What a loopback record's time is (bench_transports' loopback mode).
LOOPBACK_STATISTIC = ("the median over the timed replays of (replay time / calls per replay), minus the median of the "
                      "fill-only graph's; one timing rank (loopback: rank 0 of W, stand-in peers)")


def document(benchmark: str, doc: str, hardware: str, args, fill_us: dict, records: list[dict], *, statistic: str,
             **extra) -> dict:
    """The result document: what ran where, the timing settings and the statistic the times are, the records, and
    the benchmark's own fields."""
    import torch

    return {
        "benchmark": benchmark,
        "what": doc.strip().splitlines()[0],
        "hardware": f"1x {torch.cuda.get_device_name()} ({hardware})",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "calls_per_graph": args.calls,
        "iters": args.iters,
        "warmup_replays": args.warmup,
        "statistic": statistic,
        "fill_us_per_call": fill_us,
        "timestamp": io.utc_now(),
        "records": records,
        **extra,
    }


def main(run: Callable[[argparse.Namespace], dict], kind: str, doc: str, argv=None, *, iters: int,
         calls: int, mode: str = "loopback", options: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """Parse --out/--iters/--calls (and the benchmark's own `options`), run, write `<kind>_<gpu>_<mode>.json`; exit
    1 when any record's result was wrong."""
    import torch

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(io.RESULTS_DIR))
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--calls", type=int, default=calls)
    p.add_argument("--warmup", type=int, default=WARMUP_REPLAYS, help="untimed replays of each graph first")
    if options is not None:
        options(p)
    args = p.parse_args(argv)
    result = run(args)
    path = Path(args.out) / f"{kind}_{io.gpu_slug(torch.cuda.get_device_name())}_{mode}.json"
    io.write_json(path, result)
    print(f"wrote {path}")
    return 1 if any(r["result_correct"] is False for r in result["records"]) else 0
