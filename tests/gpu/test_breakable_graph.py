"""Our kernels inside SGLang 0.5.23's breakable CUDA graphs (the prefill graphs that are on by default there).

Why this should hold (hooks/distributed.py's _must_use_original does not exclude breakable graphs): a breakable
graph is a list of ordinary stream captures cut at eager break points; replay runs segment, break, segment...
on the replaying stream. Our calls sit inside segments exactly as they sit inside a decode graph. What
differs from a decode graph, and what this test exercises, is: several segments per graph, an eager step
between our captured calls that itself launches work, capture on a side stream with replay on another,
and interleaving with a plain CUDA graph that uses the same workspace.

Evidence: benchmarks/results/gpu_tests_h100_sglang_shared.xml (1x H100, ranks sharing it). Needs the
built sgl_kernel_sm120, sglang 0.5.23 (e.g. from the .sgl carry) and `cuda-bindings` (SGLang's breakable graph
queries capture status through it; the GPU image has it), and one GPU per rank or ranks sharing one
(tests/gpu/sglang_harness.py: two processes capture and replay on one GPU; the kernels need only CUDA IPC
between them).
Run: pytest -m gpu tests/gpu/test_breakable_graph.py
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch.distributed as dist

from tests.gpu import sglang_harness
from tests.gpu.harness import dirty_halves, run_ranks
from tests.sglang_versions import requires_sglang

pytestmark = [pytest.mark.gpu, requires_sglang("0.5.23"), sglang_harness.needs(2)]

WORLD = 2
ROWS, HIDDEN = 24, 7168
EPS = 1e-6
REPLAYS = 20


def _ints(shape, seed, device, low=-8, high=9):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int32).to(torch.bfloat16).to(device)


def _inputs(step, rank, world, device):
    xs = [_ints((ROWS, HIDDEN), 1000 * step + r, device) for r in range(world)]
    residual = _ints((ROWS, HIDDEN), 1000 * step + 97, device)
    weight = _ints((HIDDEN,), 1000 * step + 98, device, 1, 4)
    return xs, residual, weight


def _scenario(rank, world):
    # An eager break weak-references what it reads through sgl_kernel, missing on the GPU machine: the harness
    # hands back the tensor itself there (see tests/gpu/sglang_harness.py).
    sglang_harness.patch_weak_ref_tensor(rank)
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
        BreakableCUDAGraph,
        BreakableCUDAGraphCapture,
        eager_on_graph,
        enable_breakable_cuda_graph,
    )

    from sgl_kernel_sm120 import IpcAllReduce, reference_all_reduce, reference_all_reduce_add_rmsnorm

    assert importlib.metadata.version("sglang") == "0.5.23"
    device = torch.device("cuda", torch.cuda.current_device())
    ar = IpcAllReduce(dist.group.WORLD, torch.cuda.current_device(), 4 * ROWS * HIDDEN)
    failures = []
    try:
        xs, residual, weight = _inputs(0, rank, world, device)
        x = xs[rank].clone()
        residual, weight = residual.clone(), weight.clone()
        scale = torch.ones((), dtype=torch.bfloat16, device=device)

        @eager_on_graph
        def eager_scale(t):
            # An eager step between captured segments that launches its own kernel, as attention does.
            return t * scale

        graph = BreakableCUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        with enable_breakable_cuda_graph(), BreakableCUDAGraphCapture(cuda_graph=graph, stream=stream,
                                                                      barrier_fn=dist.barrier):
            plain = ar.all_reduce(x)  # segment 1
            scaled = eager_scale(plain)  # break
            fused = ar.all_reduce_add_rmsnorm(x, residual, weight, EPS)  # segment 2
            again = ar.all_reduce(scaled.contiguous())  # still segment 2: a reduction of the break's output
        torch.cuda.current_stream().wait_stream(stream)
        if len(graph._segments) != 2:
            failures.append(f"expected 2 segments, captured {len(graph._segments)}")

        # A plain CUDA graph on the same workspace, replayed in between, as decode graphs would be.
        decode = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(decode, stream=side):
            decode_out = ar.all_reduce(x[:3])
        torch.cuda.current_stream().wait_stream(side)

        for step in range(1, REPLAYS + 1):
            xs, res_new, w_new = _inputs(step, rank, world, device)
            x.copy_(xs[rank])
            residual.copy_(res_new)
            weight.copy_(w_new)
            graph.replay()
            decode.replay()
            torch.cuda.synchronize()
            want_plain = reference_all_reduce(xs)
            if not torch.equal(plain, want_plain):
                failures.append(f"replay {step}: plain all-reduce in segment 1 wrong")
            if not torch.equal(fused[1], reference_all_reduce_add_rmsnorm(xs, res_new, w_new, EPS)[1]):
                failures.append(f"replay {step}: fused residual in segment 2 wrong")
            if not torch.equal(again, (want_plain.float() * world).to(torch.bfloat16)):
                failures.append(f"replay {step}: reduction of the eager break's output wrong")
            if not torch.equal(decode_out, want_plain[:3]):
                failures.append(f"replay {step}: interleaved decode graph wrong")
            if failures:
                break
        if dirty_halves(ar):
            failures.append("scratch not clean after replays")
        del graph, decode
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


def test_kernels_captured_inside_breakable_graph_segments():
    run_ranks(WORLD, _scenario)
