"""A one-process group's ranks (local_group.local_group) as W parallel branches of one CUDA graph, so their kernels
run at once and wait for one another (bench_transports' concurrent mode, bench_tuner_pick)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def capture_concurrent(streams: Sequence[Any], call: Callable[[int], Any], calls: int) -> Any:
    """`calls` eager calls per rank, then one graph of `calls` calls per rank, rank r's `call(r)` on `streams[r]`.

    The eager warm-up launches call-major (every rank's call k before any rank's call k + 1): with CUDA's lazy
    module loading a rank-major order deadlocks until the kernels' timeout (local_group.local_group). In the graph
    every branch waits for the capture stream first and the capture stream for every branch last, so a replay is
    one call of the whole group."""
    import torch

    for _ in range(calls):
        for r, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                call(r)
    torch.cuda.synchronize()
    main = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        for stream in streams:
            stream.wait_stream(main)
        for r, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                for _ in range(calls):
                    call(r)
        for stream in streams:
            main.wait_stream(stream)
    return graph
