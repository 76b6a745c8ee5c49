"""The fused boundary and the dispatch, with a fake backend on CPU against the real SGLang modules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

import sglang_sm120  # noqa: E402
from sglang_sm120.core.config import OverlaySettings  # noqa: E402
from sglang_sm120.core.gate import GateDecision  # noqa: E402
from sglang_sm120.hooks import distributed as hooks_distributed  # noqa: E402
from sglang_sm120.hooks import fusion as hooks_fusion
from sglang_sm120.routing.book import RouteBook  # noqa: E402
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
    set_routes(backend, RouteBook.seeds(backend.workspace.shape, backend.workspace.limits))
    backend._test_group = group  # keep the weakly referenced coordinator alive
    return backend


def set_routes(backend, routes):
    """What build() does once the routes are known: the fused token counts that are ours."""
    backend.routes, backend._fused = routes, {}
    backend.fused_tokens = frozenset(t for t in range(1, backend.max_fused_tokens + 1) if backend._fused_route(
        t, HIDDEN, torch.bfloat16, backend.workspace.admits_fused(t, HIDDEN, torch.bfloat16)))


@pytest.fixture
def backend(monkeypatch):
    b = fake_backend()
    monkeypatch.setattr(hooks_fusion, "tp_backend", lambda: b)
    return b


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
def test_fusion_gate_yes_only_when_enabled_and_tokens_fit(overlay, backend, monkeypatch):
    from sglang.srt.layers import communicator

    assert [communicator.apply_flashinfer_allreduce_fusion(t) for t in (0, 1, 8, 9, 2048)] == [
        False, True, True, False, False,
    ]
    monkeypatch.setattr(hooks_fusion, "tp_backend", lambda: None)
    assert not any(communicator.apply_flashinfer_allreduce_fusion(t) for t in (1, 8))


def test_fusion_gate_defers_to_upstream_when_ours_says_no():
    calls = []
    gate = hooks_fusion.wrap_fusion_gate(lambda bs: calls.append(bs) or "upstream")
    assert gate(5) == "upstream" and calls == [5]


def test_fusion_gate_says_no_where_a_tuned_table_routes_the_fused_call_to_nccl(backend):
    from sglang_sm120.routing.book import TABLE
    from sglang_sm120.routing.table import NCCL, Point, RoutingTable

    points = [Point(r, r * HIDDEN * 2, {NCCL: 20.0, "sm120/ONESHOT/push/device": 10.0 if r <= 3 else 30.0})
              for r in range(1, 9)]
    table = RoutingTable.from_points(key={}, measured="now", workload={"hidden": HIDDEN},
                                     measurements={("bfloat16", "fused"): points})
    set_routes(backend, RouteBook(TABLE, table=table, path="p", shape=backend.workspace.shape,
                                  limits=backend.workspace.limits))
    assert [hooks_fusion.fused_backend(t) is not None for t in (1, 3, 4, 8, 9)] == [True, True, False, False, False]


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


def test_a_closed_backend_or_one_without_fusion_never_claims_a_boundary(overlay, monkeypatch):
    b = fake_backend()
    monkeypatch.setattr(hooks_fusion, "tp_backend", lambda: b)
    assert hooks_fusion.fused_backend(2) is b
    b.close()  # a workspace gone: no token count is ours
    assert hooks_fusion.fused_backend(2) is None
    b = fake_backend()
    b.fused_tokens = frozenset()  # what build() leaves when fused calls would not reduce over this group
    monkeypatch.setattr(hooks_fusion, "tp_backend", lambda: b)
    assert hooks_fusion.fused_backend(2) is None


# ---------------------------------------------------------------------------------------------------------
# _forward_with_allreduce_fusion


def reference(x_reduced, residual, norm):
    return norm.forward_native(x_reduced.clone(), residual.clone())


def test_fused_call_uses_kernel_and_returns_fresh_residual(overlay, backend):
    norm = rmsnorm()
    x, residual = ints(3, HIDDEN, seed=1), ints(3, HIDDEN, seed=2)
    x_before, residual_before = x.clone(), residual.clone()
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
    _, res_out = norm.forward_with_allreduce_fusion(x, residual, post_residual_addition=extra)
    assert torch.equal(res_out, (x.float() * WORLD + residual.float() + extra.float()).to(x.dtype))


def test_declining_kernel_still_reduces_never_returns_unreduced_norm(overlay, backend, monkeypatch):
    norm = rmsnorm()
    monkeypatch.setattr(backend, "fused_route_for", lambda *a: None)
    x, residual = ints(3, HIDDEN, seed=4), ints(3, HIDDEN, seed=5)
    residual_before = residual.clone()
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
    assert fused(norm, ints(9, HIDDEN), ints(9, HIDDEN), None, norm.weight, False) == "upstream"  # T too large
    assert fused(norm, ints(2, HIDDEN), None, None, norm.weight, True) == "upstream"  # no residual
    assert seen == [(9, False, False), (2, True, True)]
    assert backend.stats["sm120_fused"] == 0


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


def test_should_fuse_is_false_for_marked_layers_only_with_backend(monkeypatch):
    should_fuse = hooks_fusion.wrap_should_fuse_mlp(lambda self, fb: True)
    plain, captured = SimpleNamespace(), SimpleNamespace(**{hooks_fusion.KEEP_MLP_ALLREDUCE: True})
    monkeypatch.setattr(hooks_fusion, "tp_backend", lambda: SimpleNamespace(fused_tokens=frozenset({1})))
    assert should_fuse(plain, None) is True
    assert should_fuse(captured, None) is False
    monkeypatch.setattr(hooks_fusion, "tp_backend", lambda: None)
    assert should_fuse(captured, None) is True  # backend off: upstream unchanged
    monkeypatch.setattr(hooks_fusion, "tp_backend", lambda: SimpleNamespace(fused_tokens=frozenset()))
    assert should_fuse(captured, None) is True  # built, but not fusing: upstream unchanged
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
