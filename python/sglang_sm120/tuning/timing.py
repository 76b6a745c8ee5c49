"""CUDA-graph timing, the one way the tuner and every benchmark time: K calls captured back to back into one graph,
warmup replays, then R replays each timed with CUDA events; per call = replay / K; per replay the slowest rank's
time (gathered over a CPU group afterwards, never with NCCL between spinning kernels); reported: the median."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any


def aggregate_iteration_times(per_rank: Sequence[Sequence[float]]) -> dict:
    """per_rank[r][i]: rank r's time of iteration i -> the median (and spread) over iterations of the slowest rank's
    time: a collective is done only when its slowest rank is."""
    if not per_rank or not per_rank[0]:
        raise ValueError("no timings")
    n = len(per_rank[0])
    if any(len(r) != n for r in per_rank):
        raise ValueError("ranks report different iteration counts")
    worst = sorted(max(r[i] for r in per_rank) for i in range(n))
    return {"median_us": statistics.median(worst), "p10_us": worst[int(0.1 * (n - 1) + 0.5)],
            "p90_us": worst[int(0.9 * (n - 1) + 0.5)], "min_us": worst[0], "iters": n}


def calls_per_replay(nbytes: int, base: int = 20) -> int:
    """K: calls captured per graph, a function of the size only (the same on every rank)."""
    return base if nbytes <= 1 << 20 else max(1, base // (2 if nbytes <= 8 << 20 else 5))


def capture_graph(step: Callable[[int], Any], calls: int, *, eager_warmup: int = 1, stream: Any = None) -> tuple:
    """(graph, outputs): ``step(k)`` for k in range(calls), run eagerly ``eager_warmup`` times, then captured into
    one graph (on ``stream`` if given, e.g. SGLang's graph_capture stream)."""
    import torch

    for _ in range(eager_warmup):
        for k in range(calls):
            step(k)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
        outs = [step(k) for k in range(calls)]
    torch.cuda.synchronize()
    return g, outs


def replay_times(graph: Any, iters: int, *, warmup: int = 0, sync_each: bool = False) -> list[float]:
    """This rank's us per replay of ``graph``: ``warmup`` untimed replays, then ``iters`` timed ones back to back
    (the warmup absorbs the ranks' host skew), or each awaited before the next with ``sync_each``."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for _ in range(warmup):
        graph.replay()
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
        if sync_each:
            end.synchronize()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1000.0 for start, end in events]


def short_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
