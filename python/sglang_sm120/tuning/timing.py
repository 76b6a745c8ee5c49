"""CUDA-graph timing, the one way the tuner and every benchmark time: K calls captured back to back into one graph,
warmup replays, then R replays each timed with CUDA events; per call = replay / K; per replay the MAX over ranks
(gathered over a CPU group afterwards, never with NCCL between spinning kernels); reported: the MEDIAN over
replays. (Moved here from benchmarks/harness/timing.py, which now hands these names on.)"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any


def aggregate_iteration_times(per_rank: Sequence[Sequence[float]]) -> dict:
    """per_rank[r][i]: rank r's time of iteration i. Per iteration take the max over ranks (the collective is
    only done when its slowest rank is); report the median of those maxima, plus spread."""
    if not per_rank or not per_rank[0]:
        raise ValueError("no timings")
    n = len(per_rank[0])
    if any(len(r) != n for r in per_rank):
        raise ValueError("ranks report different iteration counts")
    worst = [max(r[i] for r in per_rank) for i in range(n)]
    srt = sorted(worst)

    def pct(p: float) -> float:
        return srt[min(n - 1, max(0, int(math.floor(p * (n - 1) + 0.5))))]

    return {
        "median_us": statistics.median(worst),
        "p10_us": pct(0.10),
        "p90_us": pct(0.90),
        "min_us": srt[0],
        "iters": n,
    }


def calls_per_replay(nbytes: int, base: int = 20) -> int:
    """K: calls captured per graph. Identical on all ranks (a function of the size only)."""
    if nbytes <= 1 << 20:
        return base
    if nbytes <= 8 << 20:
        return max(1, base // 2)
    return max(1, base // 5)


def capture_graph(
    step: Callable[[int], Any], calls: int, *, eager_warmup: int = 1, stream: Any = None
) -> tuple[Any, list]:
    """Run ``step(k)`` for k in range(calls) eagerly ``eager_warmup`` times, then capture the same calls into
    one graph (on ``stream`` if given, e.g. SGLang's graph_capture stream). Returns (graph, outputs)."""
    import torch

    for _ in range(eager_warmup):
        for k in range(calls):
            step(k)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    outs: list = []
    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
        for k in range(calls):
            outs.append(step(k))
    torch.cuda.synchronize()
    return g, outs


def replay_times(graph: Any, iters: int, *, warmup: int = 0, sync_each: bool = False) -> list[float]:
    """This rank's us per replay of ``graph``, timed with CUDA events: ``warmup`` untimed replays, then ``iters``
    timed ones, back to back (no host sync in between, so host skew between ranks is absorbed by the warmup
    replays) unless ``sync_each`` makes the host wait for each replay before it launches the next."""
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for _ in range(warmup):
        graph.replay()
    for i in range(iters):
        starts[i].record()
        graph.replay()
        ends[i].record()
        if sync_each:
            ends[i].synchronize()
    torch.cuda.synchronize()
    return [starts[i].elapsed_time(ends[i]) * 1000.0 for i in range(iters)]


def short_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def time_graph(graph: Any, *, calls: int, iters: int, warmup: int, gather: Callable[[Any], list],
               barrier: Callable[[], Any] | None = None) -> dict:
    """Replay ``graph`` warmup + iters times (``replay_times``); per-call us = replay / calls; ``gather`` (every
    rank's object, rank order, over a CPU group) the per-rank lists; MAX over ranks per iteration; MEDIAN over
    iterations. Raises the same error on every rank if any rank failed."""
    if barrier is not None:
        barrier()
    local, err = None, None
    try:
        local = [t / calls for t in replay_times(graph, iters, warmup=warmup)]
    except Exception as e:  # noqa: BLE001
        err = short_error(e)
    gathered = gather((local, err))
    errs = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if errs:
        raise RuntimeError("timing failed: " + "; ".join(errs))
    out = aggregate_iteration_times([g[0] for g in gathered])
    out["calls_per_replay"] = calls
    return out
