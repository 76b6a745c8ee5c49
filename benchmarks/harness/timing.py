"""The benchmarks' timing: sglang_sm120.tuning.timing, the tuner's own (one way to time, written once), and
`time_graph` over the benchmarks' Dist (its gloo all-gather and barrier)."""

from __future__ import annotations

from typing import Any

from sglang_sm120.tuning.timing import (
    aggregate_iteration_times,
    calls_per_replay,
    capture_graph,
    replay_times,
    short_error,
)

__all__ = ["aggregate_iteration_times", "calls_per_replay", "capture_graph", "replay_times", "time_graph"]


def time_graph(d, graph: Any, *, calls: int, iters: int, warmup: int) -> dict:
    """``replay_times`` / calls on every rank after a barrier, gathered over the benchmark's gloo group and
    aggregated (the slowest rank per replay, the median); raises the same error on every rank if any rank failed."""
    d.barrier()
    local, err = None, None
    try:
        local = [t / calls for t in replay_times(graph, iters, warmup=warmup)]
    except Exception as e:  # noqa: BLE001
        err = short_error(e)
    gathered = d.all_gather_obj((local, err))
    errs = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if errs:
        raise RuntimeError("timing failed: " + "; ".join(errs))
    out = aggregate_iteration_times([g[0] for g in gathered])
    out["calls_per_replay"] = calls
    return out
