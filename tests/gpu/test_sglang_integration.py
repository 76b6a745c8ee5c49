"""The overlay inside SGLang's real distributed layer, on 2 GPUs (mode "on", so it runs on the H200s).

Two spawned processes each run SGLang's own `init_distributed_environment` + `initialize_model_parallel` with
the overlay active, build the workspace through the real pre-capture seam, then check against exact integer
sums (bf16 holds them exactly):
- `tensor_model_parallel_all_reduce`: small tensors served by the sm120 kernel (even with SGLang's
  CustomAllReduceV2 enabled on NVLink), large ones by SGLang's own path (counters say which);
- `RMSNorm.forward_with_allreduce_fusion`: the fused kernel, fresh residual, inputs untouched, outputs
  bitwise equal across ranks; the never-decline fallback; the fusion gate's token bound;
- the same inside SGLang's `graph_capture()` + `torch.cuda.graph(g, stream=ctx.stream)`, replayed with new
  inputs; `destroy` releases the workspace.
Every check's outcome is gathered over gloo so all ranks fail together, naming the failing rank.

Run: pytest -m gpu tests/gpu/test_sglang_integration.py  (needs the sglang wheels; sgl_kernel/flashinfer are
replaced by stand-ins when missing, see sglang_sm120/testing/standins.py).
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (os.path.join(REPO, "python"), REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tests.sglang_versions import requires_sglang  # noqa: E402

WORLD = 2
HIDDEN = 7168  # Kimi-K2.5
MAX_BS = 8  # CUDA-graph batch bound given to the server args
DRAFT_TOKENS = 4  # EAGLE-3 verify: bound = 8 x 4 tokens = 32 rows
BOUND_ROWS = MAX_BS * DRAFT_TOKENS
SMALL_ROWS = (1, 3, BOUND_ROWS)
LARGE_ROWS = 4 * BOUND_ROWS
EPS = 1e-6
DEADLINE_S = 540


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.gpu(2)
@requires_sglang("0.5.13.post1")  # drives 0.5.13.post1's seams (ModelRunner pre-capture, layers.communicator)
def test_overlay_in_sglang_distributed_layer():
    import importlib.util

    import torch.multiprocessing as mp

    if importlib.util.find_spec("sglang") is None:  # not imported here: it needs the stand-ins first
        pytest.skip("sglang is not installed")
    port = _free_port()
    context = mp.start_processes(_worker, args=(WORLD, port), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):  # raises with the child's traceback if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"ranks did not finish within {DEADLINE_S}s (a hang: every wait should be bounded)")


# ---------------------------------------------------------------------------------------------------------
# worker (runs in each spawned process)


class _Checks:
    """Runs named checks; after each, every rank learns every rank's outcome and all raise together."""

    def __init__(self, cpu_group, rank):
        self.cpu_group, self.rank = cpu_group, rank

    def __call__(self, name, fn):
        import traceback

        import torch.distributed as dist

        try:
            fn()
            local = None
        except Exception as exc:
            local = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        outcomes = [None] * dist.get_world_size(self.cpu_group)
        dist.all_gather_object(outcomes, local, group=self.cpu_group)
        failed = {r: o for r, o in enumerate(outcomes) if o}
        if failed:
            detail = "\n".join(f"[rank {r}] {o}" for r, o in sorted(failed.items()))
            raise AssertionError(f"check {name!r} failed:\n{detail}")


def _ints(shape, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(torch.bfloat16)


def _exact_sum(shape, tag, world):
    import torch

    total = sum(_ints(shape, 1000 * r + tag).float() for r in range(world))
    return total.to(torch.bfloat16)


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["SGLANG_SM120_ALLREDUCE"] = "on"
    os.environ.pop("SGLANG_SM120_ALLREDUCE_MAX_BYTES", None)
    from sglang_sm120.testing import standins

    standins.install()  # only for whichever of sgl_kernel / flashinfer is missing

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)

    import sglang_sm120

    sglang_sm120.activate()
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.layers import communicator
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sgl_kernel_sm120 import reference_add_rmsnorm

    server_args = ServerArgs(model_path="dummy")
    server_args.cuda_graph_max_bs = MAX_BS
    server_args.speculative_algorithm = "EAGLE3"
    server_args.speculative_num_draft_tokens = DRAFT_TOKENS
    set_global_server_args_for_scheduler(server_args)
    assert server_args.sm120_allreduce == "on"

    ps.init_distributed_environment(
        world_size=world, rank=rank, local_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}", backend="nccl",
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    tp = ps.get_tp_group()
    check = _Checks(ps.get_world_group().cpu_group, rank)
    comm = getattr(tp, "sm120_comm", None)

    def gate_enabled():
        assert comm is not None, "no sm120 backend attached to the tp group"
        assert comm.gate_enabled, f"gate said no: {comm.decision}"

    check("gate", gate_enabled)

    # The pre-capture seam's replacement, with what it reads of a ModelRunner. (model_runner itself cannot be
    # imported without sgl_kernel's torch ops, so the seam's target module is not loaded here.)
    from sglang_sm120.hooks import distributed as hooks_distributed

    runner = type("Runner", (), {})()
    runner.server_args = server_args
    runner.model_config = type("ModelConfig", (), {"hidden_size": HIDDEN})()
    runner.dtype = torch.bfloat16
    pre_capture = hooks_distributed.wrap_pre_capture(lambda self: None)

    def build():
        pre_capture(runner)
        assert comm.active, f"workspace not built: {comm.build_error}"
        assert comm.max_bytes == BOUND_ROWS * HIDDEN * 2, comm.max_bytes
        assert comm.max_fused_tokens == BOUND_ROWS
        assert comm.fusion_groups_ok

    check("build via pre-capture seam", build)

    def plain_eager():
        before = dict(comm.stats)
        for rows in SMALL_ROWS + (LARGE_ROWS,):
            inp = _ints((rows, HIDDEN), 1000 * rank + rows).to(device)
            kept = inp.clone()
            out = tensor_model_parallel_all_reduce(inp)
            torch.cuda.synchronize()
            expect = _exact_sum((rows, HIDDEN), rows, world).to(device)
            assert torch.equal(out, expect), f"rows={rows}: wrong sum"
            if rows <= BOUND_ROWS:
                assert torch.equal(inp, kept), f"rows={rows}: sm120 all-reduce wrote its input"
        assert comm.stats["sm120"] - before["sm120"] == len(SMALL_ROWS), comm.stats
        assert comm.stats["fallback"] - before["fallback"] == 1, comm.stats

    check("plain all-reduce, eager", plain_eager)

    def make_norm(**kwargs):
        norm = RMSNorm(HIDDEN, eps=EPS, **kwargs).to(device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_((_ints((HIDDEN,), 77).abs() % 3 + 1).to(device))
        norm._forward_method = norm.forward_native  # forward_cuda needs sgl_kernel, absent here
        return norm

    norm = make_norm()

    def fused_expect(rows, tag):
        summed = sum(_ints((rows, HIDDEN), 1000 * r + tag).float() for r in range(world)).to(device)
        residual = _ints((rows, HIDDEN), 500 + tag).to(device)
        return reference_add_rmsnorm(summed, residual, norm.weight.detach(), EPS)

    def all_ranks_equal(tensor):
        gathered = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(gathered, tensor.contiguous(), group=tp.device_group)
        return all(torch.equal(g, gathered[0]) for g in gathered)

    def fused_eager():
        gate = [bool(communicator.apply_flashinfer_allreduce_fusion(t)) for t in (0, 1, BOUND_ROWS, BOUND_ROWS + 1)]
        assert gate == [False, True, True, False], gate
        before = comm.stats["sm120_fused"]
        for rows in SMALL_ROWS:
            x = _ints((rows, HIDDEN), 1000 * rank + rows).to(device)
            residual = _ints((rows, HIDDEN), 500 + rows).to(device)
            x_kept, residual_kept = x.clone(), residual.clone()
            out, residual_out = norm.forward_with_allreduce_fusion(x, residual, use_attn_tp_group=False)
            torch.cuda.synchronize()
            ref_out, ref_residual = fused_expect(rows, rows)
            assert torch.equal(residual_out, ref_residual), f"rows={rows}: residual_out is not the exact sum"
            torch.testing.assert_close(out, ref_out, atol=0.05, rtol=0.02)
            assert torch.equal(x, x_kept) and torch.equal(residual, residual_kept), "fused op wrote an input"
            assert residual_out.data_ptr() != residual.data_ptr(), "residual_out is not fresh"
            assert all_ranks_equal(out) and all_ranks_equal(residual_out), "ranks differ bitwise"
        assert comm.stats["sm120_fused"] - before == len(SMALL_ROWS), comm.stats

    check("fused all-reduce + add + RMSNorm, eager", fused_eager)

    def fused_fallback():
        # A norm variant with other numerics: the kernel must not take it, and the call must still reduce.
        odd = make_norm(cast_x_before_out_mul=True)
        before = dict(comm.stats)
        x = _ints((3, HIDDEN), 1000 * rank + 3).to(device)
        residual = _ints((3, HIDDEN), 503).to(device)
        residual_kept = residual.clone()
        out, residual_out = odd.forward_with_allreduce_fusion(x, residual)
        torch.cuda.synchronize()
        summed = _exact_sum((3, HIDDEN), 3, world).to(device)
        ref_out, ref_residual = odd.forward_native(summed, residual_kept.clone())
        assert torch.equal(residual_out, ref_residual) and torch.equal(out, ref_out), "fallback result wrong"
        assert torch.equal(residual, residual_kept), "fallback wrote the caller's residual"
        assert comm.stats["fused_fallback"] - before["fused_fallback"] == 1, comm.stats
        assert comm.stats["sm120"] - before["sm120"] == 1, "fallback's all-reduce should use the plain kernel"

    check("fused call the kernel declines", fused_fallback)

    # CUDA graph: capture on SGLang's side stream, replay with new inputs on the default stream.
    small_in = torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=device)
    large_in = torch.zeros(LARGE_ROWS, HIDDEN, dtype=torch.bfloat16, device=device)
    fused_x = torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=device)
    fused_residual = torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=device)

    def forward():
        small_out = tensor_model_parallel_all_reduce(small_in)
        large_out = tensor_model_parallel_all_reduce(large_in * 1)  # the original path may reduce in place
        norm_out, residual_out = norm.forward_with_allreduce_fusion(fused_x, fused_residual)
        return small_out, large_out, norm_out, residual_out

    def fill(step):
        small_in.copy_(_ints((3, HIDDEN), 1000 * rank + 10 * step + 1))
        large_in.copy_(_ints((LARGE_ROWS, HIDDEN), 1000 * rank + 10 * step + 2))
        fused_x.copy_(_ints((3, HIDDEN), 1000 * rank + 10 * step + 3))
        fused_residual.copy_(_ints((3, HIDDEN), 500 + 10 * step + 3))

    graph_state = {}

    def capture():
        from sglang.srt.distributed.parallel_state import graph_capture

        fill(0)
        before = dict(comm.stats)
        with graph_capture() as ctx:
            for _ in range(2):  # eager warm-up inside the capture context, as CudaGraphRunner does
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=ctx.stream):
                outs = forward()
        torch.cuda.synchronize()
        captured = {k: comm.stats[k] - before[k] for k in comm.stats}
        assert captured["sm120"] == 3 and captured["sm120_fused"] == 3 and captured["fallback"] == 3, captured
        graph_state.update(graph=graph, outs=outs, stats=dict(comm.stats))

    check("capture", capture)

    def replay():
        graph, outs = graph_state["graph"], graph_state["outs"]
        for step in (1, 2, 3):
            fill(step)
            graph.replay()
            torch.cuda.synchronize()
            small_out, large_out, norm_out, residual_out = outs
            assert torch.equal(small_out, _exact_sum((3, HIDDEN), 10 * step + 1, world).to(device)), f"step {step}"
            assert torch.equal(large_out, _exact_sum((LARGE_ROWS, HIDDEN), 10 * step + 2, world).to(device))
            ref_out, ref_residual = fused_expect(3, 10 * step + 3)
            assert torch.equal(residual_out, ref_residual), f"step {step}: fused residual wrong after replay"
            torch.testing.assert_close(norm_out, ref_out, atol=0.05, rtol=0.02)
            assert all_ranks_equal(norm_out), f"step {step}: ranks differ bitwise"
        assert comm.stats == graph_state["stats"], "replays must not run Python dispatch"
        # eager calls still work after replays (device-side protocol state stayed in step)
        inp = _ints((3, HIDDEN), 1000 * rank + 3).to(device)
        assert torch.equal(tensor_model_parallel_all_reduce(inp), _exact_sum((3, HIDDEN), 3, world).to(device))

    check("replay with new inputs", replay)

    graph_state.clear()
    torch.cuda.synchronize()
    ps.destroy_model_parallel()

    def destroyed():
        assert comm.comm is None, "workspace not released by GroupCoordinator.destroy"

    destroyed()
    ps.destroy_distributed_environment()
