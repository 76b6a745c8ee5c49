"""The overlay inside SGLang's real distributed layer (mode "on", so it runs on the H200s), on either supported
release (0.5.23, 0.5.13.post1), with one GPU per rank (NCCL) or ranks sharing one GPU (gloo; see
tests/gpu/sglang_harness.py for the mode and the harness's patches).

Two spawned ranks each run SGLang's own `init_distributed_environment` + `initialize_model_parallel` with the
overlay active, build the workspace through the pre-capture seam's replacement, then check against exact
integer sums (bf16 holds them exactly), each check agreed by both ranks:
- `tensor_model_parallel_all_reduce`: small tensors served by the sm120 kernel (ahead of SGLang's own
  communicators), large ones by SGLang's own path, each asserted by the backend's counters (`stats`);
- the fused all-reduce + residual add + RMSNorm reached through SGLang's own code: 0.5.13.post1's fusion gate
  (`layers.communicator`) and `RMSNorm.forward_with_allreduce_fusion`; 0.5.23's `layer_boundary` gates (both
  modules that hold it) and its fused attention-input / FFN-input kernels; fresh residual, inputs untouched,
  bitwise equal across ranks; a norm the kernel declines still reduces (never an un-reduced norm);
- EAGLE-3 aux hidden-state captures: 0.5.13.post1 keeps the MLP all-reduce of the layers feeding a captured
  layer (SGLang's `set_eagle3_layers_to_capture` + `LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer`
  with the overlay's guard); 0.5.23 completes a capture layer's owed sum before the capture reads it
  (`StageBoundary._prepare_attention`), through our kernel, so no guard is needed there;
- 0.5.23: SGLang's own PCIe-IPC all-reduce, asked for with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1, set aside;
- SGLang's `graph_capture()` + `torch.cuda.graph(g, stream=ctx.stream)`, replayed with new inputs (the replays
  counted on the device, none by the Python counters); `destroy` releases the workspace.

Run: pytest -m gpu tests/gpu/test_sglang_integration.py (needs sglang, e.g. from the .sgl carry; sgl_kernel and
flashinfer are replaced by stand-ins when missing).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (os.path.join(REPO, "python"), REPO):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tests.gpu import sglang_harness  # noqa: E402
from tests.gpu.sglang_harness import Checks, all_ranks_equal, exact_sum, ints  # noqa: E402

DRY_RUN_OK = True  # runs on a CPU with SGL_SM120_TEST_DRY_RUN=1 (tests/gpu/sglang_harness.py)
WORLD = 2
HIDDEN = 7168  # Kimi-K2.5
MAX_BS = 8  # CUDA-graph batch bound (0.5.13.post1: server args; 0.5.23: the runner's widest decode rows)
DRAFT_TOKENS = 4  # EAGLE-3 verify: bound = 8 x 4 tokens = 32 rows
BOUND_ROWS = MAX_BS * DRAFT_TOKENS
SMALL_ROWS = (1, 3, BOUND_ROWS)
LARGE_ROWS = 4 * BOUND_ROWS
EPS = 1e-6
REPLAYS = 3
PCIE_ENV = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"

pytestmark = [pytest.mark.gpu, sglang_harness.needs(WORLD)]


def test_overlay_in_sglang_distributed_layer():
    sglang_harness.run(WORLD, _scenario, timeout_s=420)


# ---------------------------------------------------------------------------------------------------------
# worker (runs in each spawned process)


def _scenario(rank: int, world: int, plan) -> None:
    import torch

    ctx = sglang_harness.start(
        rank, world, plan, mode="on",
        # 0.5.23: SGLang's own PCIe-IPC all-reduce is asked for too; ours must set it aside. (0.5.13.post1 has
        # none; the variable means nothing there.)
        env={PCIE_ENV: "1"},
        server_args_0513={"cuda_graph_max_bs": MAX_BS, "speculative_algorithm": "EAGLE3",
                          "speculative_num_draft_tokens": DRAFT_TOKENS},
    )
    check = Checks(ctx)
    tp, comm, device = ctx.tp, ctx.comm, ctx.device
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    def gate():
        assert comm is not None, "no sm120 backend attached to the tp group"
        assert comm.gate_enabled, f"gate said no: {comm.decision}"
        if plan.shared:  # the harness's patches took: nothing of SGLang's opens NCCL or IPC of its own
            assert tp.pynccl_comm is None and tp.ca_comm is None, (tp.pynccl_comm, tp.ca_comm)

    check("gate passes on SGLang's TP group", gate)

    if ctx.is_0523:
        check("0.5.23: SGLang's PCIe-IPC all-reduce set aside at group init", lambda: _upstream_pcie_aside(ctx))

    check("workspace built by the pre-capture seam", lambda: _build(ctx))

    if ctx.is_0523:
        check("0.5.23: SGLang's PCIe-IPC all-reduce still aside after the build", lambda: _upstream_pcie_after(ctx))

    def plain_eager():
        before = dict(comm.stats)
        for rows in SMALL_ROWS + (LARGE_ROWS,):
            inp = ints((rows, HIDDEN), 1000 * rank + rows).to(device)
            kept = inp.clone()
            out = tensor_model_parallel_all_reduce(inp)
            _sync(ctx)
            assert torch.equal(out.cpu(), exact_sum((rows, HIDDEN), rows, world)), f"rows={rows}: wrong sum"
            if rows <= BOUND_ROWS:
                assert torch.equal(inp, kept), (f"rows={rows}: the input was written (SGLang's in-place path served "
                                                f"it?), stats {comm.stats}, routes: {comm.routes.source_line()}")
        delta = {k: comm.stats[k] - before[k] for k in before}
        assert delta == {"sm120": len(SMALL_ROWS), "sm120_fused": 0, "fallback": 1, "fused_fallback": 0}, delta

    check("plain all-reduce: small -> sm120, large -> SGLang's path (eager)", plain_eager)

    norm = _norm(ctx)
    fused = _fused_paths(ctx, norm)
    check(f"fusion gate ({fused.gate_names})", fused.check_gate)

    def fused_eager():
        before = comm.stats["sm120_fused"]
        for rows in SMALL_ROWS:
            for path_name, call in fused.calls:
                tag = rows + (50 if path_name != fused.calls[0][0] else 0)
                x = ints((rows, HIDDEN), 1000 * rank + tag).to(device)
                residual = ints((rows, HIDDEN), 500 + tag).to(device)
                x_kept, residual_kept = x.clone(), residual.clone()
                out, residual_out = call(x, residual)
                _sync(ctx)
                ref_out, ref_residual = _fused_expect(norm, rows, tag, world)
                where = f"{path_name}, rows={rows}"
                assert torch.equal(residual_out.cpu(), ref_residual), f"{where}: residual_out is not the exact sum"
                torch.testing.assert_close(out.cpu(), ref_out, atol=0.05, rtol=0.02, msg=where)
                assert torch.equal(x, x_kept) and torch.equal(residual, residual_kept), f"{where}: wrote an input"
                assert residual_out.data_ptr() != residual.data_ptr(), f"{where}: residual_out is not fresh"
                assert all_ranks_equal(ctx, out) and all_ranks_equal(ctx, residual_out), f"{where}: ranks differ"
        assert comm.stats["sm120_fused"] - before == len(SMALL_ROWS) * len(fused.calls), comm.stats

    check(f"fused all-reduce + add + RMSNorm through {', '.join(n for n, _ in fused.calls)} (eager)", fused_eager)

    def fused_declined():
        # A norm variant with other numerics: the kernel must not take it, and the call must still reduce.
        odd = _norm(ctx, cast_x_before_out_mul=True)
        before = dict(comm.stats)
        x = ints((3, HIDDEN), 1000 * rank + 3).to(device)
        residual = ints((3, HIDDEN), 503).to(device)
        residual_kept = residual.clone()
        assert fused.ask(3), "the norm gate did not claim 3 rows"  # as SGLang asks before every fused call
        out, residual_out = odd.forward_with_allreduce_fusion(x, residual)
        _sync(ctx)
        summed = exact_sum((3, HIDDEN), 3, world).to(device)
        ref_out, ref_residual = odd.forward_native(summed, residual_kept.clone())
        assert torch.equal(residual_out, ref_residual) and torch.equal(out, ref_out), "fallback result wrong"
        assert torch.equal(residual, residual_kept), "the fallback wrote the caller's residual"
        assert comm.stats["fused_fallback"] - before["fused_fallback"] == 1, comm.stats
        assert comm.stats["sm120"] - before["sm120"] == 1, "the fallback's all-reduce should be the plain kernel"

    check("a norm the fused kernel declines: reduce, then SGLang's norm", fused_declined)

    if ctx.is_0523:
        check("0.5.23: a capture layer's owed sum is completed (by sm120) before the capture reads it",
              lambda: _eagle3_capture_0523(ctx))
    else:
        check("0.5.13.post1: layers feeding EAGLE-3 captures keep their MLP all-reduce",
              lambda: _eagle3_guard_0513(ctx, norm))

    if not plan.dry_run:
        _graph_checks(ctx, check, norm, fused)

    ctx.finish()

    def destroyed():
        assert comm.workspace is None, "workspace not released by GroupCoordinator.destroy"

    check("destroy releases the workspace", destroyed)


def _sync(ctx) -> None:
    import torch

    if ctx.device.type == "cuda":
        torch.cuda.synchronize()


def _norm(ctx, **kwargs):
    import torch
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(HIDDEN, eps=EPS, **kwargs).to(device=ctx.device, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_((ints((HIDDEN,), 77).abs() % 3 + 1).to(ctx.device))
    # SGLang's CUDA norm is sgl_kernel's (a stand-in here): its own native forward does the unfused norms.
    norm._forward_method = norm.forward_native
    return norm


def _fused_expect(norm, rows, tag, world):
    from sgl_kernel_sm120 import reference_add_rmsnorm

    summed = exact_sum((rows, HIDDEN), tag, world)
    residual = ints((rows, HIDDEN), 500 + tag)
    return reference_add_rmsnorm(summed, residual, norm.weight.detach().cpu(), EPS)


# ---------------------------------------------------------------------------------------------------------
# the build and SGLang's own PCIe-IPC all-reduce


def _build(ctx) -> None:
    import torch

    from sglang_sm120.hooks import distributed as hooks_distributed

    # The replacement the seam table installs, around a no-op original: SGLang's runner modules cannot be
    # imported on the GPU machine (they need sgl_kernel's torch ops / flashinfer.comm, absent there).
    model_config = SimpleNamespace(hidden_size=HIDDEN)
    if ctx.is_0523:

        model_runner = SimpleNamespace(server_args=hooks_distributed.runtime_server_args(), model_config=model_config,
                                       dtype=torch.bfloat16, is_draft_worker=False)
        runner = SimpleNamespace(model_runner=model_runner, _widest_decode_rows=lambda: BOUND_ROWS)
        hooks_distributed.wrap_runner_pre_capture(lambda self: None)(runner)
    else:
        runner = SimpleNamespace(server_args=hooks_distributed.runtime_server_args(), model_config=model_config,
                                 dtype=torch.bfloat16)
        hooks_distributed.wrap_pre_capture(lambda self: None)(runner)
    comm = ctx.comm
    assert comm.active, f"workspace not built: {comm.build_error}"
    assert comm.max_bytes == BOUND_ROWS * HIDDEN * 2, comm.max_bytes
    assert comm.max_fused_tokens == BOUND_ROWS, comm.max_fused_tokens
    assert comm.fused_tokens, "no fused token count is ours (attention-TP / MoE groups not the TP group?)"
    if ctx.rank == 0 and not ctx.plan.dry_run:
        enabled = [line for line in ctx.log_lines if "ENABLED" in line]
        assert len(enabled) == 1 and "transport: CUDA IPC (P2P)" in enabled[0], ctx.log_lines


def _upstream_pcie_aside(ctx) -> None:
    from sglang.srt.distributed.device_communicators.pcie_ipc_ar import PcieIpcCommunicator

    from sglang_sm120.hooks import upstream_pcie

    tp = ctx.tp
    assert upstream_pcie.upstream_pcie_ipc_requested(), f"{PCIE_ENV}=1 did not reach SGLang's env registry"
    aside = getattr(tp, upstream_pcie.SET_ASIDE_ATTR, None)
    assert isinstance(aside, PcieIpcCommunicator), f"SGLang's PCIe-IPC communicator was not set aside: {aside!r}"
    assert tp.pcie_ipc_comm is None, tp.pcie_ipc_comm
    if ctx.rank == 0:
        said = [line for line in ctx.log_lines if upstream_pcie.ENV in line and "not built" in line]
        assert said, f"no log line says SGLang's PCIe-IPC workspace is not built: {ctx.log_lines}"


def _upstream_pcie_after(ctx) -> None:
    import torch

    tp = ctx.tp
    assert tp.pcie_ipc_comm is None, "handed back to SGLang's PCIe-IPC all-reduce although ours is built"
    small = torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=ctx.device)
    method = tp._resolve_outplace_all_reduce_method(small)
    assert method != "pcie_ipc", method  # SGLang's own dispatcher does not pick it either


# ---------------------------------------------------------------------------------------------------------
# the fused boundary, through each release's own code


def _fused_paths(ctx, norm):
    """The release's fusion gates and the SGLang functions that reach the fused kernel: (name, call(x, r))."""
    from types import SimpleNamespace as NS

    from sglang_sm120.hooks import fusion as hooks_fusion

    def fresh_answers(gate):
        """The gate's answers with no claim standing (a yes claims the next fused call; none follows here)."""
        answers = []
        for t in (0, 1, BOUND_ROWS, BOUND_ROWS + 1):
            hooks_fusion._claim = None
            answers.append(bool(gate(t)))
        hooks_fusion._claim = None
        return answers

    if not ctx.is_0523:
        from sglang.srt.layers import communicator

        def check_gate():
            answers = fresh_answers(communicator.apply_flashinfer_allreduce_fusion)
            assert answers == [False, True, True, False], answers

        def attn_input(x, r):  # prepare_attn's ask, then its fused call
            assert communicator.apply_flashinfer_allreduce_fusion(x.shape[0]), "the gate did not claim the call"
            return norm.forward_with_allreduce_fusion(x, r, use_attn_tp_group=False)

        return NS(gate_names="layers.communicator.apply_flashinfer_allreduce_fusion", check_gate=check_gate,
                  calls=[("LayerCommunicator.prepare_attn's gate + RMSNorm.forward_with_allreduce_fusion", attn_input)],
                  ask=communicator.apply_flashinfer_allreduce_fusion)

    from sglang.srt.layers.layer_boundary import exit as exit_mod
    from sglang.srt.layers.layer_boundary.fusions import allreduce
    from sglang.srt.layers.layer_boundary.output import UnreducedOutput
    from sglang.srt.layers.moe.utils import post_experts_reduction_group

    plan = NS(norm=norm)

    def check_gate():
        for gate in (allreduce.flashinfer_ar_fusion_applies, exit_mod.flashinfer_ar_fusion_applies):
            answers = fresh_answers(gate)
            assert answers == [False, True, True, False], (gate.__module__, answers)
        assert post_experts_reduction_group() is ctx.tp, "the MoE output's sum is not over the TP group"
        value = ints((3, HIDDEN), 1).to(ctx.device)
        # SGLang skips the clone of a captured residual on this answer: the fused path must return a fresh one.
        assert allreduce.flashinfer_preserves_residual(value, None)
        hooks_fusion._claim = None  # the FFN input it speaks for does not follow here

    def ffn_input(x, r):
        return allreduce.fused_ffn_input(plan, x, r, None)

    def attn_input(x, r):
        owed = UnreducedOutput(partial=x, group=post_experts_reduction_group())
        return allreduce.fused_attn_input(plan, owed, r, None, None, fuses_quant=False, keep_bf16=False)

    return NS(gate_names="layer_boundary.fusions.allreduce / exit .flashinfer_ar_fusion_applies",
              check_gate=check_gate, calls=[("fused_ffn_input", ffn_input), ("fused_attn_input", attn_input)],
              ask=allreduce.flashinfer_ar_fusion_applies)


# ---------------------------------------------------------------------------------------------------------
# EAGLE-3


def _eagle3_guard_0513(ctx, norm) -> None:
    """SGLang's set_eagle3_layers_to_capture (from its source: models.deepseek_v2 cannot be imported on the GPU
    machine) behind the seam's wrapper marks the layers feeding captures; SGLang's own
    should_fuse_mlp_allreduce_with_next_layer, behind the overlay's guard, then keeps their MLP all-reduce,
    while every other layer defers it into the next norm because the built backend's gate says yes."""
    import torch
    from sglang.srt.layers.communicator import LayerCommunicator, LayerScatterModes, ScatterMode

    from sglang_sm120.hooks import fusion as hooks_fusion

    set_layers = hooks_fusion.wrap_set_layers_to_capture(sglang_harness.upstream_function(
        "sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM.set_eagle3_layers_to_capture"))
    num_layers = 6
    modes = LayerScatterModes(layer_input_mode=ScatterMode.TP_ATTN_FULL, attn_mode=ScatterMode.TP_ATTN_FULL,
                              mlp_mode=ScatterMode.FULL, middle_residual_mode=ScatterMode.TP_ATTN_FULL,
                              layer_output_mode=ScatterMode.TP_ATTN_FULL)
    layers = [SimpleNamespace(layer_communicator=LayerCommunicator(
        layer_scatter_modes=modes, input_layernorm=norm, post_attention_layernorm=norm,
        is_last_layer=i == num_layers - 1)) for i in range(num_layers)]
    lm = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                         config=SimpleNamespace(num_hidden_layers=num_layers),
                         model=SimpleNamespace(layers=layers, layers_to_capture=[]))
    set_layers(lm, [1, 3])  # SGLang shifts ids that start at 1: captures before layers 2 and 4
    assert lm.model.layers_to_capture == [2, 4], lm.model.layers_to_capture
    batch = SimpleNamespace(input_ids=torch.zeros(3, dtype=torch.long, device=ctx.device))
    fuse = [layer.layer_communicator.should_fuse_mlp_allreduce_with_next_layer(batch) for layer in layers]
    # layers 1 and 3 feed the captures; the last layer has no next norm
    assert fuse == [True, False, True, False, True, False], fuse


def _eagle3_capture_0523(ctx) -> None:
    """SGLang's StageBoundary._prepare_attention on a real ResidualStream holding a real UnreducedOutput over
    the TP group (the plan-dependent steps `_select`/`_prepare` stubbed): with a capture, the owed sum is
    completed, through GroupCoordinator.all_reduce and so our kernel, before the norm step reads it and before
    the capture reads the residual; without one it reaches the norm step still owed (where the fused kernel
    completes it). Hazard (a) of 0.5.13.post1 (a capture reading an un-reduced partial) cannot happen."""
    import torch
    from sglang.srt.layers.layer_boundary.output import UnreducedOutput
    from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD
    from sglang.srt.layers.layer_boundary.residual.stream import OwedOutput, ResidualStream
    from sglang.srt.layers.layer_boundary.stage import StageBoundary

    comm, device, world = ctx.comm, ctx.device, ctx.world
    entry = SimpleNamespace(capture_move=None, capture_preserves_residual=None, capture_move_allocates=False,
                            input_move=None, input_retainable=False)
    seen = []

    def prepare(hidden_states, stream, forward_batch, steps, **kwargs):
        seen.append(hidden_states)
        if isinstance(hidden_states, OwedOutput):  # what the fused add + norm would take: complete it here
            hidden_states = stream.complete(hidden_states)
        stream.write(hidden_states + stream.residual)
        return stream.residual, stream

    stub = SimpleNamespace(_select=lambda hidden_states, forward_batch: (hidden_states, SimpleNamespace(entry=entry)),
                           _prepare=prepare)
    for with_capture in (True, False):
        seen.clear()
        captured = []
        partial = ints((3, HIDDEN), 1000 * ctx.rank + 91).to(device)
        previous = ints((3, HIDDEN), 591).to(device)
        stream = ResidualStream(residual=previous.clone())
        handle = stream.record(UnreducedOutput(partial=partial, group=ctx.tp), PLAIN_ADD)
        before = comm.stats["sm120"]
        capture = (lambda value, owned=False, into=captured: into.append(value.clone())) if with_capture else None
        StageBoundary._prepare_attention(stub, handle, stream, None, capture=capture)
        _sync(ctx)
        want = (exact_sum((3, HIDDEN), 91, world).float() + ints((3, HIDDEN), 591).float()).to(torch.bfloat16)
        assert comm.stats["sm120"] - before == 1, f"capture={with_capture}: the owed sum did not go to sm120"
        if with_capture:
            assert len(seen) == 1 and isinstance(seen[0], torch.Tensor), "the norm step got the sum still owed"
            assert torch.equal(seen[0].cpu(), exact_sum((3, HIDDEN), 91, world)), "completed sum wrong"
            assert len(captured) == 1 and torch.equal(captured[0].cpu(), want), "the capture read a wrong value"
        else:
            assert len(seen) == 1 and isinstance(seen[0], OwedOutput), "without a capture the sum was completed early"
        assert torch.equal(stream.residual.cpu(), want)


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs


def _graph_checks(ctx, check, norm, fused) -> None:
    import torch
    from sglang.srt.distributed import tensor_model_parallel_all_reduce
    from sglang.srt.distributed.parallel_state import graph_capture

    comm, device, world, rank = ctx.comm, ctx.device, ctx.world, ctx.rank
    # A gloo reduction (SGLang's path when ranks share a GPU) cannot be captured: the graph then holds only calls
    # our kernels serve, and the large call is checked eagerly above. With NCCL it is captured too.
    capture_large = not ctx.plan.shared
    fused_name, fused_call = fused.calls[0]
    small_in = torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=device)
    large_in = torch.zeros(LARGE_ROWS, HIDDEN, dtype=torch.bfloat16, device=device)
    fused_x = torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=device)
    fused_residual = torch.zeros(3, HIDDEN, dtype=torch.bfloat16, device=device)

    def forward():
        small_out = tensor_model_parallel_all_reduce(small_in)
        norm_out, residual_out = fused_call(fused_x, fused_residual)
        large_out = tensor_model_parallel_all_reduce(large_in * 1) if capture_large else None  # may be in place
        return small_out, norm_out, residual_out, large_out

    def fill(step):
        small_in.copy_(ints((3, HIDDEN), 1000 * rank + 10 * step + 1))
        fused_x.copy_(ints((3, HIDDEN), 1000 * rank + 10 * step + 3))
        fused_residual.copy_(ints((3, HIDDEN), 500 + 10 * step + 3))
        large_in.copy_(ints((LARGE_ROWS, HIDDEN), 1000 * rank + 10 * step + 2))

    state = {}

    def capture():
        fill(0)
        before = dict(comm.stats)
        with graph_capture() as graph_ctx:
            for _ in range(2):  # eager warm-up inside the capture context, as SGLang's graph runners do
                forward()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=graph_ctx.stream):
                outs = forward()
        torch.cuda.synchronize()
        delta = {k: comm.stats[k] - before[k] for k in before}
        want = {"sm120": 3, "sm120_fused": 3, "fallback": 3 if capture_large else 0, "fused_fallback": 0}
        assert delta == want, delta
        state.update(graph=graph, outs=outs, stats=dict(comm.stats), device_calls=comm.device_calls())
        assert state["device_calls"] is not None, "the device call counter could not be read"

    check(f"capture in SGLang's graph_capture(): plain + {fused_name}"
          + (" + SGLang's path" if capture_large else ""), capture)

    def replay():
        graph, outs = state["graph"], state["outs"]
        for step in range(1, REPLAYS + 1):
            fill(step)
            graph.replay()
            torch.cuda.synchronize()
            small_out, norm_out, residual_out, large_out = outs
            assert torch.equal(small_out.cpu(), exact_sum((3, HIDDEN), 10 * step + 1, world)), f"step {step}"
            ref_out, ref_residual = _fused_expect(norm, 3, 10 * step + 3, world)
            assert torch.equal(residual_out.cpu(), ref_residual), f"step {step}: fused residual wrong after replay"
            torch.testing.assert_close(norm_out.cpu(), ref_out, atol=0.05, rtol=0.02)
            assert all_ranks_equal(ctx, norm_out), f"step {step}: ranks differ bitwise"
            if capture_large:
                assert torch.equal(large_out.cpu(), exact_sum((LARGE_ROWS, HIDDEN), 10 * step + 2, world))
        assert comm.stats == state["stats"], "replays must not run Python dispatch"
        calls = comm.device_calls() - state["device_calls"]
        assert calls == 2 * REPLAYS, f"the device counted {calls} kernel calls in {REPLAYS} replays, not {2 * REPLAYS}"
        # eager calls still work after replays (the device-side protocol state stayed in step)
        inp = ints((3, HIDDEN), 1000 * rank + 3).to(device)
        assert torch.equal(tensor_model_parallel_all_reduce(inp).cpu(), exact_sum((3, HIDDEN), 3, world))

    check(f"{REPLAYS} replays with new inputs", replay)
    state.clear()
    torch.cuda.synchronize()
