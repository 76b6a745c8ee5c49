"""The benchmarks' timing: sglang_sm120.tuning.timing, the tuner's own (one way to time, written once), with
`time_graph` taking the benchmarks' Dist (its gloo all-gather and barrier)."""

from __future__ import annotations

from typing import Any

from sglang_sm120.tuning import timing as _timing
from sglang_sm120.tuning.timing import aggregate_iteration_times, calls_per_replay, capture_graph, replay_times

__all__ = ["aggregate_iteration_times", "calls_per_replay", "capture_graph", "replay_times", "time_graph"]


def time_graph(d, graph: Any, *, calls: int, iters: int, warmup: int) -> dict:
    """sglang_sm120.tuning.timing.time_graph over the benchmark's gloo group."""
    return _timing.time_graph(graph, calls=calls, iters=iters, warmup=warmup, gather=d.all_gather_obj,
                              barrier=d.barrier)
