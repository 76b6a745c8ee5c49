"""The fused boundary and the dispatch, with a fake backend on CPU against the real SGLang modules."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

import sglang_sm120  # noqa: E402
from sglang_sm120.core.config import OverlaySettings  # noqa: E402
from sglang_sm120.core.gate import GateDecision  # noqa: E402
from sglang_sm120.hooks import distributed as hooks_distributed  # noqa: E402
from sglang_sm120.hooks import fusion as hooks_fusion
from sglang_sm120.routing.book import SEEDS, RouteBook  # noqa: E402
from sglang_sm120.runtime.backend import TPBackend  # noqa: E402
from tests.sglang_versions import requires_sglang  # noqa: E402
from tests.support.fakes import FakeGroupCoordinator, FakeIpcAllReduce  # noqa: E402

# Tests of 0.5.13.post1's own seams (the rest of this file holds for every supported SGLang).
ONLY_0513 = requires_sglang("0.5.13.post1")

HIDDEN = 64
WORLD = 2


@pytest.fixture
def overlay():
    sglang_sm120.activate()
    yield
    sglang_sm120.deactivate()


def fake_backend(max_tokens=8, world=WORLD):
    group = FakeGroupCoordinator(world)
    backend = TPBackend(
        name="tp:0", ranks=list(range(world)), rank_in_group=0, world_size=world, device=torch.device("cpu"),
        settings=OverlaySettings(mode="on", agreement_timeout_s=1.0), deterministic=False, group=group)
    backend.decision = GateDecision(True, "test")
    backend.workspace = FakeIpcAllReduce(max_numel=max_tokens * HIDDEN, world_size=world)
    backend.max_bytes, backend.max_fused_tokens, backend.hidden_size = max_tokens * HIDDEN * 2, max_tokens, HIDDEN
    backend.dtype = torch.bfloat16
    # Built, and routed by the seeds (every size within the bound ours): until its routes are resolved a
    # backend sends every size to NCCL.
    set_routes(backend, RouteBook(SEEDS, shape=backend.workspace.shape, limits=backend.workspace.limits))
    backend._test_group = group  # keep the weakly referenced coordinator alive
    return backend


def set_routes(backend, routes):
    """What build() does once the routes are known: the fused token counts that are ours."""
    backend.routes, backend._fused = routes, {}
    backend.fused_tokens = frozenset(
        t for t in range(1, backend.max_fused_tokens + 1)
        if backend.workspace.admits_fused(t, HIDDEN, torch.bfloat16) and backend._fused_route(t, HIDDEN, torch.bfloat16)
    )


@pytest.fixture
def backend():
    b = fake_backend()
    hooks_fusion.serve(b)
    return b


# A norm's ask of the fusion gate, as every release's boundary code makes it before the fused call (upstream's
# own answer stands in as "no").
norm_gate = hooks_fusion.wrap_norm_gate(lambda batch_size: False)


def fresh_answers(gate, counts):
    """The gate's answer for each token count, each asked with no claim standing (no fused call follows)."""
    answers = []
    for count in counts:
        hooks_fusion._claim = None
        answers.append(bool(gate(count)))
    hooks_fusion._claim = None
    return answers


def ints(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(torch.bfloat16)


def rmsnorm():
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(ints(HIDDEN, seed=99).abs() + 1)
    norm._forward_method = norm.forward_native  # CPU: no sgl_kernel
    return norm


# ---------------------------------------------------------------------------------------------------------
# fusion gate


@ONLY_0513
def test_fusion_gate_yes_only_when_enabled_and_tokens_fit(overlay, backend):
    from sglang.srt.layers import communicator

    gate = communicator.apply_flashinfer_allreduce_fusion
    assert fresh_answers(gate, (0, 1, 8, 9, 2048)) == [False, True, True, False, False]
    hooks_fusion.serve(None)
    assert fresh_answers(gate, (1, 8)) == [False, False]


def test_fusion_gate_defers_to_upstream_when_ours_says_no():
    calls = []
    gate = hooks_fusion.wrap_norm_gate(lambda bs: calls.append(bs) or "upstream")
    assert gate(5) == "upstream" and calls == [5]
    assert hooks_fusion._claim is None


def test_fusion_gate_says_no_where_a_tuned_table_routes_the_fused_call_to_nccl(backend):
    from sglang_sm120.routing.book import TABLE
    from sglang_sm120.routing.table import NCCL, Point, RoutingTable

    points = [Point(r, r * HIDDEN * 2, {NCCL: 20.0, "sm120/ONESHOT/push/device": 10.0 if r <= 3 else 30.0})
              for r in range(1, 9)]
    table = RoutingTable.from_points(key={}, measured="now", workload={"hidden": HIDDEN},
                                     measurements={("bfloat16", "fused"): points})
    set_routes(backend, RouteBook(TABLE, table=table, path="p", shape=backend.workspace.shape,
                                  limits=backend.workspace.limits))
    assert fresh_answers(norm_gate, (1, 3, 4, 8, 9)) == [True, True, False, False, False]


def test_a_yes_is_a_claim_every_ask_honours_until_the_fused_call_takes_it_up(overlay, backend):
    assert norm_gate(2)
    assert hooks_fusion._claim is backend
    assert norm_gate(9)  # 9 rows are not ours, but a claim stands: the answer is not recomputed
    norm = rmsnorm()
    x, residual = ints(9, HIDDEN, seed=1), ints(9, HIDDEN, seed=2)
    out, res_out = norm.forward_with_allreduce_fusion(x, residual)
    # the claimed call completes its sum once, without a kernel for its rows: an all-reduce, then the norm
    assert backend.stats["fused_fallback"] == 1 and backend.group_coordinator.all_reduce_calls == 1
    ref_out, ref_res = reference((x.float() * WORLD).to(x.dtype), residual, norm)
    assert torch.equal(res_out, ref_res) and torch.equal(out, ref_out)
    assert hooks_fusion._claim is None and not norm_gate(9)


def test_a_source_decides_afresh_and_voids_a_claim_no_norm_took_up(backend):
    source_gate = hooks_fusion.wrap_source_gate(lambda batch_size: False)
    assert norm_gate(2)
    assert not source_gate(9) and hooks_fusion._claim is None
    assert source_gate(3) and hooks_fusion._claim is backend


def test_prepare_tp_backend_builds_with_the_settings_parsed_when_the_group_was_attached(monkeypatch):
    from sglang_sm120.core import config

    backend = fake_backend()
    backend.workspace = None
    seen = []
    monkeypatch.setattr(backend, "build", lambda hidden, dtype, bound, **kw: seen.append(
        (kw["tune"], bound.max_bytes)) or False)
    monkeypatch.setattr(hooks_distributed, "sglang_group", lambda name: SimpleNamespace(sm120_backend=backend))
    monkeypatch.setattr(hooks_distributed, "fusion_reduces_over", lambda group: True)
    monkeypatch.setenv(config.TUNE_ENV, "off")  # not read again: the settings were parsed once, at attach
    monkeypatch.setenv(config.MAX_BYTES_ENV, "8192")
    backend.settings = OverlaySettings(mode="on", max_bytes=4096, tune="force")
    hooks_distributed.prepare_tp_backend(SimpleNamespace(cuda_graph_max_bs=8), 7168, torch.bfloat16)
    assert seen == [("force", 4096)]


def test_a_closed_backend_or_one_without_fusion_never_claims_a_boundary():
    b = fake_backend()
    hooks_fusion.serve(b)
    assert fresh_answers(norm_gate, (2,)) == [True]
    b.close()  # a workspace gone: no token count is ours
    assert fresh_answers(norm_gate, (2,)) == [False]
    b = fake_backend()
    b.fused_tokens = frozenset()  # what build() leaves when fused calls would not reduce over this group
    hooks_fusion.serve(b)
    assert fresh_answers(norm_gate, (2,)) == [False]


def test_no_claim_is_made_while_torch_compile_traces(backend, monkeypatch):
    monkeypatch.setattr(hooks_fusion, "_is_compiling", lambda: True)
    assert not norm_gate(2) and not hooks_fusion.wrap_source_gate(lambda n: False)(2)
    assert hooks_fusion._claim is None


# ---------------------------------------------------------------------------------------------------------
# _forward_with_allreduce_fusion


def reference(x_reduced, residual, norm):
    return norm.forward_native(x_reduced.clone(), residual.clone())


def test_fused_call_uses_kernel_and_returns_fresh_residual(overlay, backend):
    norm = rmsnorm()
    x, residual = ints(3, HIDDEN, seed=1), ints(3, HIDDEN, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
    assert norm_gate(3)
    out, res_out = norm.forward_with_allreduce_fusion(x, residual)
    assert backend.stats["sm120_fused"] == 1 and backend.stats["fused_fallback"] == 0
    ref_out, ref_res = reference((x.float() * WORLD).to(x.dtype), residual, norm)
    assert torch.equal(res_out, ref_res)
    torch.testing.assert_close(out, ref_out, atol=0.05, rtol=0.02)
    assert res_out is not residual and res_out.data_ptr() != residual.data_ptr()
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_fused_call_folds_post_residual_addition(overlay, backend):
    norm = rmsnorm()
    x, residual, extra = ints(2, HIDDEN, seed=1), ints(2, HIDDEN, seed=2), ints(2, HIDDEN, seed=3)
    assert norm_gate(2)
    _, res_out = norm.forward_with_allreduce_fusion(x, residual, post_residual_addition=extra)
    assert torch.equal(res_out, (x.float() * WORLD + residual.float() + extra.float()).to(x.dtype))


def test_declining_kernel_still_reduces_never_returns_unreduced_norm(overlay, backend, monkeypatch):
    norm = rmsnorm()
    monkeypatch.setattr(backend, "fused_route_for", lambda *a: None)
    x, residual = ints(3, HIDDEN, seed=4), ints(3, HIDDEN, seed=5)
    residual_before = residual.clone()
    assert norm_gate(3)
    out, res_out = norm.forward_with_allreduce_fusion(x, residual)
    assert backend.stats["fused_fallback"] == 1 and backend.stats["sm120_fused"] == 0
    assert backend.group_coordinator.all_reduce_calls == 1
    ref_out, ref_res = reference((x.float() * WORLD).to(x.dtype), residual_before, norm)
    assert torch.equal(res_out, ref_res) and torch.equal(out, ref_out)
    unreduced_out, _ = reference(x, residual_before, norm)
    assert not torch.equal(out, unreduced_out)
    assert torch.equal(residual, residual_before) and res_out is not residual  # fresh residual (hazard c)


def test_norm_variants_with_other_numerics_take_the_fallback(overlay, backend):
    norm = rmsnorm()
    norm.cast_x_before_out_mul = True
    x, residual = ints(2, HIDDEN, seed=6), ints(2, HIDDEN, seed=7)
    assert norm_gate(2)
    out, res_out = norm.forward_with_allreduce_fusion(x, residual)
    assert backend.stats["fused_fallback"] == 1
    ref_out, ref_res = reference((x.float() * WORLD).to(x.dtype), residual, norm)
    assert torch.equal(res_out, ref_res) and torch.equal(out, ref_out)


def test_calls_our_gate_did_not_claim_go_upstream(backend):
    seen = []

    def upstream(norm_module, x, residual, post, weight, use_attn_tp_group):
        seen.append((x.shape[0], residual is None, use_attn_tp_group))
        return "upstream"

    fused = hooks_fusion.replace_forward_with_allreduce_fusion(upstream)
    norm = rmsnorm()
    assert fused(norm, ints(2, HIDDEN), ints(2, HIDDEN), None, norm.weight, False) == "upstream"  # nothing asked
    assert not norm_gate(9)  # upstream's own gate said yes
    assert fused(norm, ints(9, HIDDEN), ints(9, HIDDEN), None, norm.weight, False) == "upstream"
    assert seen == [(2, False, False), (9, False, False)]
    assert backend.stats["sm120_fused"] == 0 and hooks_fusion._claim is None


def test_a_claimed_call_without_a_residual_still_completes_its_sum(overlay, backend):
    norm = rmsnorm()
    x = ints(2, HIDDEN, seed=7)
    assert norm_gate(2)
    out = norm.forward_with_allreduce_fusion(x, None)
    assert backend.group_coordinator.all_reduce_calls == 1 and backend.stats["fused_fallback"] == 1
    assert torch.equal(out, norm.forward_native((x.float() * WORLD).to(x.dtype)))


def test_route_memo_holds_sizes_within_the_bound_only(overlay, backend):
    norm = rmsnorm()
    for rows in (2, 2, 3, 9, 12, 9):
        hooks_fusion._claim = backend  # as a source's claim would: every call here is ours
        norm.forward_with_allreduce_fusion(ints(rows, HIDDEN), ints(rows, HIDDEN))
    assert sorted(shape[0] for shape, _ in hooks_fusion._routes) == [2, 3]
    assert sorted(backend._fused) == [(t, HIDDEN, torch.bfloat16) for t in range(1, 9)]
    assert backend.stats["sm120_fused"] == 3 and backend.stats["fused_fallback"] == 3


# ---------------------------------------------------------------------------------------------------------
# 0.5.13.post1's boundary, through SGLang's own LayerCommunicator code: the source asks on the batch's token
# count, the norm on the partial sum's rows


def sglang_0513_layer(norm, *, capture=False):
    """What LayerCommunicator's should-fuse-MLP, prepare_attn and prepare_mlp read of their layer (TP only)."""
    from sglang.srt.layers.communicator import CommunicateWithAllReduceAndLayerNormFn, ScatterMode

    layer = SimpleNamespace(
        input_layernorm=norm, post_attention_layernorm=norm, is_last_layer=False, _speculative_algo=None,
        layer_scatter_modes=SimpleNamespace(mlp_mode=ScatterMode.FULL), qkv_latent_func=None,
        _context=SimpleNamespace(tp_size=WORLD, attn_tp_size=WORLD, attn_dp_size=1, cache=None),
        _communicate_simple_fn=lambda hidden_states, forward_batch, context: hidden_states,
        _communicate_with_all_reduce_and_layer_norm_fn=functools.partial(
            CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual,
            residual_input_mode=ScatterMode.TP_ATTN_FULL))
    if capture:
        setattr(layer, hooks_fusion.KEEP_MLP_ALLREDUCE, True)
    return layer


@pytest.fixture
def sglang_0513_sums(monkeypatch, backend):
    """Every completed sum of the boundary, by who completed it: SGLang's own all-reduces (the MoE's at its
    source, the norm side's unfused path), ours (the fused kernel, the claimed call's all-reduce)."""
    from sglang.srt.layers import communicator

    sglang = []

    def sglang_all_reduce(t):
        sglang.append(t.shape[0])
        return (t.float() * WORLD).to(t.dtype)

    for name in ("moe_tensor_model_parallel_all_reduce", "attention_tensor_model_parallel_all_reduce"):
        monkeypatch.setattr(communicator, name, sglang_all_reduce)
    monkeypatch.setattr(communicator, "is_enable_moe_cp_allgather", lambda: False)

    def count():
        return {"sglang": len(sglang), "fused": backend.stats["sm120_fused"],
                "claimed all-reduce": backend.group_coordinator.all_reduce_calls}

    return SimpleNamespace(all_reduce=sglang_all_reduce, count=count)


def decode_batch(tokens):
    return SimpleNamespace(input_ids=torch.zeros(tokens, dtype=torch.long),
                           forward_mode=SimpleNamespace(is_decode_or_idle=lambda: True))


def sglang_0513_moe_boundary(layer, next_layer, batch, partial, residual, sums):
    """One MoE layer's end and the next layer's input as DeepseekV2DecoderLayer runs them: the source's
    decision, the MoE's own all-reduce unless deferred (then the tag), the next prepare_attn."""
    from sglang.srt.layers.communicator import LayerCommunicator

    defer = LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer(layer, batch)
    if defer:
        partial._sglang_needs_allreduce_fusion = True
    else:
        partial = sums.all_reduce(partial)
    return defer, LayerCommunicator.prepare_attn(next_layer, partial, residual, batch)


@ONLY_0513
@pytest.mark.parametrize("tokens,rows", [(4, 4), (4, 12), (12, 4), (12, 12)])  # the backend claims <= 8 tokens
def test_0513_a_deferred_moe_sum_is_completed_exactly_once_whatever_the_norms_rows(
        overlay, backend, sglang_0513_sums, tokens, rows):
    norm = rmsnorm()
    partial, residual = ints(rows, HIDDEN, seed=1), ints(rows, HIDDEN, seed=2)
    residual_before = residual.clone()
    defer, (out, res_out) = sglang_0513_moe_boundary(sglang_0513_layer(norm), sglang_0513_layer(norm),
                                                     decode_batch(tokens), partial, residual, sglang_0513_sums)
    assert defer is (tokens <= 8)  # the source's number decides
    done = sglang_0513_sums.count()
    assert sum(done.values()) == 1, done
    if defer:  # the norm honours the source's claim whatever its rows: the kernel where it serves them
        assert done["fused" if rows <= 8 else "claimed all-reduce"] == 1, done
    ref_out, ref_res = reference((partial.float() * WORLD).to(partial.dtype), residual_before, norm)
    assert torch.equal(res_out, ref_res)
    torch.testing.assert_close(out, ref_out, atol=0.05, rtol=0.02)
    assert hooks_fusion._claim is None


@ONLY_0513
@pytest.mark.parametrize("rows", [4, 12])
def test_0513_the_attention_sum_is_decided_at_its_norm_alone_and_completed_once(
        overlay, backend, sglang_0513_sums, rows):
    from sglang.srt.layers.communicator import LayerCommunicator

    norm = rmsnorm()
    partial, residual = ints(rows, HIDDEN, seed=3), ints(rows, HIDDEN, seed=4)
    residual_before = residual.clone()
    out, res_out = LayerCommunicator.prepare_mlp(sglang_0513_layer(norm), partial, residual, decode_batch(4))
    done = sglang_0513_sums.count()
    assert done == {"sglang": int(rows > 8), "fused": int(rows <= 8), "claimed all-reduce": 0}, done
    ref_out, ref_res = reference((partial.float() * WORLD).to(partial.dtype), residual_before, norm)
    assert torch.equal(res_out, ref_res)
    torch.testing.assert_close(out, ref_out, atol=0.05, rtol=0.02)


@ONLY_0513
def test_0513_a_layer_feeding_a_capture_completes_its_own_sum_and_leaves_no_claim(
        overlay, backend, sglang_0513_sums):
    norm = rmsnorm()
    partial, residual = ints(4, HIDDEN, seed=5), ints(4, HIDDEN, seed=6)
    defer, (_, res_out) = sglang_0513_moe_boundary(sglang_0513_layer(norm, capture=True), sglang_0513_layer(norm),
                                                   decode_batch(4), partial, residual.clone(), sglang_0513_sums)
    assert defer is False and sglang_0513_sums.count() == {"sglang": 1, "fused": 0, "claimed all-reduce": 0}
    assert torch.equal(res_out, (partial.float() * WORLD + residual.float()).to(partial.dtype))
    assert hooks_fusion._claim is None


@ONLY_0513
def test_0513_fused_moe_boundary_runs_at_most_ten_predicates_of_ours(overlay, backend, sglang_0513_sums):
    from benchmarks.bench_hot_path import predicates

    norm, batch = rmsnorm(), decode_batch(4)
    layer, next_layer = sglang_0513_layer(norm), sglang_0513_layer(norm)

    def boundary():
        sglang_0513_moe_boundary(layer, next_layer, batch, ints(4, HIDDEN), ints(4, HIDDEN), sglang_0513_sums)

    assert predicates(boundary)["overlay"] <= 10
    assert backend.stats["sm120_fused"] == 2


# ---------------------------------------------------------------------------------------------------------
# EAGLE-3: layers feeding captured hidden states keep their MLP all-reduce


def fake_causal_lm(num_layers=61):
    layers = [SimpleNamespace(layer_communicator=SimpleNamespace()) for _ in range(num_layers)]
    return SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=num_layers),
        model=SimpleNamespace(layers=layers, layers_to_capture=[]),
    )


def marked(causal_lm):
    return [i for i, layer in enumerate(causal_lm.model.layers)
            if getattr(layer.layer_communicator, hooks_fusion.KEEP_MLP_ALLREDUCE, False)]


@ONLY_0513
@pytest.mark.parametrize("layer_ids,expected", [(None, [1, 29, 57]), ([1, 29, 57], [1, 29, 57]), ([3, 10], [2, 9])])
def test_eagle3_capture_marks_previous_layers(overlay, layer_ids, expected):
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    lm = fake_causal_lm()
    DeepseekV2ForCausalLM.set_eagle3_layers_to_capture(lm, layer_ids)
    assert lm.model.layers_to_capture == [i + 1 for i in expected]
    assert marked(lm) == expected


def test_capture_of_layer_zero_and_missing_layers_are_skipped():
    lm = fake_causal_lm(4)
    lm.model.layers[1] = SimpleNamespace()  # a PP-missing layer has no communicator
    lm.model.layers_to_capture = [0, 2, 3]
    assert hooks_fusion.mark_layers_feeding_captures(lm) == [2]


def test_should_fuse_is_false_for_marked_layers_only_with_backend():
    upstream_answer = []

    def upstream(self, forward_batch):  # SGLang's own answer asks the gate with the batch's token count
        return norm_gate(forward_batch) or upstream_answer[0]

    should_fuse = hooks_fusion.wrap_should_fuse_mlp(upstream)
    plain, captured = SimpleNamespace(), SimpleNamespace(**{hooks_fusion.KEEP_MLP_ALLREDUCE: True})
    backend = fake_backend()
    hooks_fusion.serve(backend)
    upstream_answer[:] = [False]
    assert should_fuse(plain, 2) is True and hooks_fusion._claim is backend  # the claim the next norm honours
    assert should_fuse(captured, 2) is False and hooks_fusion._claim is None
    assert should_fuse(plain, 9) is False and hooks_fusion._claim is None
    hooks_fusion.serve(None)  # backend off: upstream unchanged
    upstream_answer[:] = [True]
    assert should_fuse(captured, 2) is True and hooks_fusion._claim is None
    backend.fused_tokens = frozenset()  # built, but not fusing: upstream unchanged
    hooks_fusion.serve(backend)
    assert should_fuse(captured, 2) is True and hooks_fusion._claim is None
    assert hooks_fusion.wrap_should_fuse_mlp(lambda self, fb: False)(plain, None) is False


@ONLY_0513
def test_should_fuse_seam_is_installed(overlay):
    from sglang.srt.layers.communicator import LayerCommunicator

    assert getattr(LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer, "__sm120_seam__", None)


# ---------------------------------------------------------------------------------------------------------
# plain all-reduce dispatch


def test_dispatch_small_to_kernel_large_and_ineligible_to_original(monkeypatch):
    monkeypatch.setattr(hooks_distributed, "must_use_original", lambda: False)
    original_calls = []
    all_reduce = hooks_distributed.wrap_group_all_reduce(lambda self, t: original_calls.append(t.shape) or "nccl")
    backend = fake_backend(max_tokens=8)
    group = SimpleNamespace(sm120_backend=backend)
    small = ints(8, HIDDEN)
    assert torch.equal(all_reduce(group, small), (small.float() * WORLD).to(small.dtype))
    assert all_reduce(group, ints(9, HIDDEN)) == "nccl"  # over the byte bound
    assert all_reduce(group, ints(4, HIDDEN).float()) == "nccl"  # kernel declines fp32
    assert backend.stats == {"sm120": 1, "sm120_fused": 0, "fallback": 2, "fused_fallback": 0}
    assert original_calls == [(9, HIDDEN), (4, HIDDEN)]
    # the route memo holds sizes within the bound only: one above it is answered before the memo
    assert sorted(backend._plain, key=str) == [(4 * HIDDEN, torch.float32), (8 * HIDDEN, torch.bfloat16)]


def test_dispatch_without_backend_is_upstream():
    all_reduce = hooks_distributed.wrap_group_all_reduce(lambda self, t: "nccl")
    assert all_reduce(SimpleNamespace(sm120_backend=None), ints(1, HIDDEN)) == "nccl"
    assert all_reduce(SimpleNamespace(), ints(1, HIDDEN)) == "nccl"
    unbuilt = fake_backend()
    unbuilt.workspace = None
    assert all_reduce(SimpleNamespace(sm120_backend=unbuilt), ints(1, HIDDEN)) == "nccl"
    assert unbuilt.stats["fallback"] == 0


def test_compiling_or_piecewise_goes_to_original(monkeypatch):
    all_reduce = hooks_distributed.wrap_group_all_reduce(lambda self, t: "nccl")
    backend = fake_backend()
    monkeypatch.setattr(hooks_distributed, "must_use_original", lambda: True)
    assert all_reduce(SimpleNamespace(sm120_backend=backend), ints(1, HIDDEN)) == "nccl"


def test_destroy_releases_workspace():
    destroyed = []
    destroy = hooks_distributed.wrap_group_destroy(lambda self: destroyed.append(True))
    backend = fake_backend()
    kernel = backend.workspace
    group = SimpleNamespace(sm120_backend=backend)
    destroy(group)
    assert kernel.closed and group.sm120_backend is None and destroyed == [True]


def test_group_init_attaches_only_to_tp_groups(monkeypatch):
    attached = []
    monkeypatch.setattr(hooks_distributed, "attach", lambda g: attached.append(g.unique_name) or "backend")

    def original_init(self, name):
        self.unique_name = name

    init = hooks_distributed.wrap_group_init(original_init)
    group = SimpleNamespace()
    init(group, "tp:0")
    assert group.sm120_backend == "backend"
    # attach() itself filters by name; a crash in it leaves the group on NCCL instead of failing init
    monkeypatch.setattr(hooks_distributed, "attach", lambda g: 1 / 0)
    other = SimpleNamespace()
    init(other, "tp:1")
    assert other.sm120_backend is None


def test_attach_filters_groups_and_mode(monkeypatch):
    cuda = SimpleNamespace(type="cuda")
    assert hooks_distributed.attach(SimpleNamespace(unique_name="world:0", world_size=2, device=cuda)) is None
    assert hooks_distributed.attach(SimpleNamespace(unique_name="tp:0", world_size=1, device=cuda)) is None
    cpu = SimpleNamespace(type="cpu")
    assert hooks_distributed.attach(SimpleNamespace(unique_name="tp:0", world_size=2, device=cpu)) is None
    from sglang_sm120.core import config

    off = SimpleNamespace(**{config.SETTINGS_ATTR: OverlaySettings(mode="off")})
    monkeypatch.setattr(hooks_distributed, "runtime_server_args", lambda: off)
    assert hooks_distributed.attach(
        SimpleNamespace(unique_name="tp:0", world_size=2, device=cuda, rank_in_group=0)
    ) is None


@ONLY_0513
def test_pre_capture_seam_builds_with_derived_bound(overlay, monkeypatch):
    from sglang.srt.model_executor.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(
        hooks_distributed, "prepare_tp_backend", lambda sa, hidden, dtype: calls.append((hidden, dtype))
    )
    runner = SimpleNamespace(
        server_args=SimpleNamespace(enable_flashinfer_allreduce_fusion=False),
        model_config=SimpleNamespace(hidden_size=7168),
        dtype=torch.bfloat16,
    )
    ModelRunner._pre_initialize_flashinfer_allreduce_workspace(runner)
    assert calls == [(7168, torch.bfloat16)]


@pytest.mark.parametrize("explicit,expected", [(None, 8 * 4 * 7168 * 2), (123456, 123456)])
def test_prepare_tp_backend_sizes_from_server_args(monkeypatch, explicit, expected):

    backend = fake_backend()
    backend.workspace = None
    backend.settings = OverlaySettings(mode="on", max_bytes=explicit)
    built = []
    monkeypatch.setattr(
        backend, "build", lambda hidden, dtype, bound, **kw: built.append((hidden, dtype, bound)) or False
    )
    monkeypatch.setattr(hooks_distributed, "sglang_group", lambda name: SimpleNamespace(sm120_backend=backend))
    monkeypatch.setattr(hooks_distributed, "fusion_reduces_over", lambda group: True)
    server_args = SimpleNamespace(
        cuda_graph_max_bs=8, cuda_graph_bs=[1, 2, 4, 8], speculative_algorithm="EAGLE3",
        speculative_num_draft_tokens=4,
    )
    hooks_distributed.prepare_tp_backend(server_args, 7168, torch.bfloat16)
    assert len(built) == 1 and built[0][:2] == (7168, torch.bfloat16)
    assert built[0][2].max_bytes == expected
