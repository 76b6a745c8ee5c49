"""SGLang 0.5.23's fused boundary, pre-capture hook and own PCIe-IPC all-reduce, with a fake backend on CPU
against the real modules. The fused-call behaviour shared with 0.5.13.post1 (kernel, fallbacks, fresh
residual) is tested in test_fusion.py, which runs here too; this file checks that SGLang 0.5.23's own
code reaches it."""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_versions import requires_sglang

pytestmark = requires_sglang("0.5.23")
pytest.importorskip("sglang")

import sglang_sm120  # noqa: E402
from sglang_sm120.hooks import distributed as hooks_distributed  # noqa: E402
from sglang_sm120.hooks import fusion as hooks_fusion  # noqa: E402
from sglang_sm120.hooks import upstream_pcie  # noqa: E402
from sglang_sm120.seams import base  # noqa: E402
from tests.overlay.hooks.test_fusion import (  # noqa: E402
    HIDDEN,
    WORLD,
    fake_backend,
    fresh_answers,
    ints,
    norm_gate,
    reference,
    rmsnorm,
)
from tests.support.fakes import FakeGroupCoordinator  # noqa: E402

BOUNDARY = "sglang.srt.layers.layer_boundary"


@pytest.fixture
def overlay():
    sglang_sm120.activate()
    yield
    sglang_sm120.deactivate()


@pytest.fixture
def backend():
    b = fake_backend()
    hooks_fusion.serve(b)
    return b


def _gate_holders(gate) -> list[str]:
    """Every imported SGLang module whose namespace holds `gate` (or our wrapper of it) under any name."""
    holders = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("sglang.") or module is None:
            continue
        for value in list(vars(module).values()):
            if value is gate or getattr(value, "__wrapped__", None) is gate:
                holders.append(name)
                break
    return sorted(holders)


# ---------------------------------------------------------------------------------------------------------
# fusion gate


def test_every_module_that_holds_the_gate_by_name_is_patched():
    import sglang.srt.layers.layer_boundary.exit  # noqa: F401
    import sglang.srt.layers.layer_boundary.fusions.allreduce  # noqa: F401
    from sglang.srt.layers.layer_boundary.residual import add_norm

    gate = add_norm.flashinfer_ar_fusion_applies
    holders = [h for h in _gate_holders(gate) if h != add_norm.__name__]
    assert holders == [f"{BOUNDARY}.exit", f"{BOUNDARY}.fusions.allreduce"]
    sglang_sm120.activate()
    try:
        for holder in holders:
            assert base.is_ours(vars(sys.modules[holder])["flashinfer_ar_fusion_applies"]), holder
        # nothing but the definition still calls SGLang's gate unwrapped
        unwrapped = [h for h in _gate_holders(gate) if vars(sys.modules[h]).get("flashinfer_ar_fusion_applies") is gate]
        assert unwrapped == [add_norm.__name__]
    finally:
        sglang_sm120.deactivate()
    assert all(vars(sys.modules[h])["flashinfer_ar_fusion_applies"] is gate for h in holders)


def test_gate_says_yes_only_when_enabled_and_tokens_fit(overlay, backend):
    from sglang.srt.layers.layer_boundary import exit as exit_mod
    from sglang.srt.layers.layer_boundary.fusions import allreduce

    for gate in (allreduce.flashinfer_ar_fusion_applies, exit_mod.flashinfer_ar_fusion_applies):
        assert fresh_answers(gate, (0, 1, 8, 9, 2048)) == [False, True, True, False, False]
    hooks_fusion.serve(None)
    # upstream's own gate answers on CPU (not SM90/SM100): no
    assert fresh_answers(allreduce.flashinfer_ar_fusion_applies, (1, 8)) == [False, False]


def test_the_exit_is_a_source_the_input_kernels_honour_its_claim(overlay, backend):
    from sglang.srt.layers.layer_boundary import exit as exit_mod
    from sglang.srt.layers.layer_boundary.fusions import allreduce

    assert allreduce.flashinfer_ar_fusion_applies(2) and allreduce.flashinfer_ar_fusion_applies(9)  # honoured
    assert not exit_mod.flashinfer_ar_fusion_applies(9)  # the exit asks afresh, and voids the standing claim
    assert not allreduce.flashinfer_ar_fusion_applies(9)
    assert exit_mod.flashinfer_ar_fusion_applies(4) and allreduce.flashinfer_ar_fusion_applies(9)


def test_fused_ffn_input_as_sglang_calls_it_reaches_our_kernel(overlay, backend, monkeypatch):
    from sglang.srt.layers.layer_boundary.fusions import allreduce

    norm = rmsnorm()
    plan = SimpleNamespace(norm=norm)
    x, residual = ints(3, HIDDEN, seed=1), ints(3, HIDDEN, seed=2)
    out, res_out = allreduce.fused_ffn_input(plan, x, residual, None)
    assert backend.stats["sm120_fused"] == 1
    ref_out, ref_res = reference((x.float() * WORLD).to(x.dtype), residual, norm)
    assert torch.equal(res_out, ref_res)
    torch.testing.assert_close(out, ref_out, atol=0.05, rtol=0.02)
    hooks_fusion.serve(None)
    assert allreduce.fused_ffn_input(plan, x, residual, None) is None  # gate no: SGLang completes unfused


def test_fused_attn_input_completes_a_deferred_moe_sum_through_our_kernel(overlay, backend, monkeypatch):
    from sglang.srt.layers.layer_boundary.fusions import allreduce
    from sglang.srt.layers.layer_boundary.output import UnreducedOutput

    moe_group = object()
    monkeypatch.setattr(allreduce, "post_experts_reduction_group", lambda: moe_group)
    norm = rmsnorm()
    plan = SimpleNamespace(norm=norm)
    x, residual = ints(2, HIDDEN, seed=3), ints(2, HIDDEN, seed=4)
    owed = UnreducedOutput(partial=x, group=moe_group)
    out, res_out = allreduce.fused_attn_input(plan, owed, residual, None, None, fuses_quant=False, keep_bf16=False)
    assert backend.stats["sm120_fused"] == 1
    assert torch.equal(res_out, (x.float() * WORLD + residual.float()).to(x.dtype))
    # another group's sum is not ours to complete: SGLang's adapter declines before asking the gate
    other = UnreducedOutput(partial=x, group=object())
    assert allreduce.fused_attn_input(plan, other, residual, None, None, fuses_quant=False, keep_bf16=False) is None
    assert backend.stats["sm120_fused"] == 1


def test_exit_defers_a_fused_consumer_sum_only_when_our_gate_takes_it(overlay, backend, monkeypatch):
    from sglang.srt.layers.layer_boundary import exit as exit_mod

    monkeypatch.setattr(exit_mod, "_ffn_has_tokens", lambda forward_batch: True)
    facts = SimpleNamespace(single_sum=False, fused_consumer_sum=True)
    batch = SimpleNamespace(input_ids=torch.zeros(4, dtype=torch.long),
                            residual_stream=SimpleNamespace(residual=None))
    assert exit_mod._batch_allows_deferred_sum(batch, facts, None) is True
    wide = SimpleNamespace(input_ids=torch.zeros(9, dtype=torch.long), residual_stream=batch.residual_stream)
    assert exit_mod._batch_allows_deferred_sum(wide, facts, None) is False  # over the workspace's 8 tokens


def test_preserves_residual_contract_follows_our_gate(overlay, backend, monkeypatch):
    from sglang.srt.layers.layer_boundary.fusions import allreduce

    monkeypatch.setattr(allreduce, "get_parallel", lambda: SimpleNamespace(attn_tp_size=WORLD))
    value = ints(4, HIDDEN)
    # SGLang skips the clone of a captured residual on this answer, so the fused path must return a fresh one
    # (checked in test_fusion.py::test_fused_call_uses_kernel_and_returns_fresh_residual).
    assert allreduce.flashinfer_preserves_residual(value, None)
    hooks_fusion._claim = None  # no FFN input follows here
    assert not allreduce.flashinfer_preserves_residual(ints(9, HIDDEN), None)


def test_the_ffn_input_keeps_the_promise_its_preserves_answer_made(overlay, backend, monkeypatch):
    """SGLang asks whether the FFN input will leave the residual in place before that input runs, and keeps the
    captured residual without a copy on a yes: the input must then take our path (a fresh residual) whatever its
    rows, and complete its sum once."""
    from sglang.srt.layers.layer_boundary.fusions import allreduce

    monkeypatch.setattr(allreduce, "get_parallel", lambda: SimpleNamespace(attn_tp_size=WORLD))
    norm = rmsnorm()
    plan = SimpleNamespace(norm=norm)
    assert allreduce.flashinfer_preserves_residual(ints(4, HIDDEN), None)
    x, residual = ints(9, HIDDEN, seed=5), ints(9, HIDDEN, seed=6)
    out, res_out = allreduce.fused_ffn_input(plan, x, residual, None)
    assert res_out is not residual and backend.group_coordinator.all_reduce_calls == 1
    assert backend.stats["fused_fallback"] == 1 and backend.stats["sm120_fused"] == 0
    ref_out, ref_res = reference((x.float() * WORLD).to(x.dtype), residual, norm)
    assert torch.equal(res_out, ref_res) and torch.equal(out, ref_out)


def test_norm_with_fused_output_quant_takes_the_reduce_then_norm_path(overlay, backend):
    norm = rmsnorm()
    norm.fuse_input_quant(torch.nn.Linear(HIDDEN, HIDDEN))  # 0.5.23's RMSNorm API for the fused FP8 quant
    assert not hooks_fusion.norm_matches_kernel(norm)
    x, residual = ints(2, HIDDEN, seed=6), ints(2, HIDDEN, seed=7)
    residual_before = residual.clone()
    assert norm_gate(2)
    out, res_out = norm.forward_with_allreduce_fusion(x, residual, use_attn_tp_group=False)
    assert backend.stats["fused_fallback"] == 1 and backend.stats["sm120_fused"] == 0
    ref_out, ref_res = reference((x.float() * WORLD).to(x.dtype), residual_before, norm)
    assert torch.equal(res_out, ref_res) and torch.equal(out, ref_out)
    assert torch.equal(residual, residual_before) and res_out is not residual


def test_gemma_norm_reaches_the_same_replacement(overlay, backend):
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    norm = GemmaRMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16)
    x, residual = ints(2, HIDDEN, seed=8), ints(2, HIDDEN, seed=9)
    assert norm_gate(2)
    norm.forward_with_allreduce_fusion(x, residual)
    assert backend.stats["sm120_fused"] + backend.stats["fused_fallback"] == 1


# ---------------------------------------------------------------------------------------------------------
# the MoE boundary through SGLang's own exit and input code: the exit asks on the batch's token count, the input
# on the partial sum's rows


@pytest.fixture
def moe_group(monkeypatch):
    """The group the MoE output's sum is owed over (the TP group, another object than the one our claimed calls
    reduce over, so that each count says who completed a sum)."""
    from sglang.srt.layers.layer_boundary import exit as exit_mod
    from sglang.srt.layers.layer_boundary.fusions import allreduce

    group = FakeGroupCoordinator(WORLD)
    monkeypatch.setattr(allreduce, "post_experts_reduction_group", lambda: group)
    monkeypatch.setattr(exit_mod, "_ffn_has_tokens", lambda forward_batch: True)
    return group


def sglang_0523_moe_boundary(tokens, partial, residual, norm, group, *, single_sum):
    """An FFN exit's decision (`_batch_allows_deferred_sum`: a LoRA / TP1-shared-expert output asks the gate, an
    ordinary one defers unasked), the sum at the source unless deferred, then the next layer's attention input
    (`_run_entry` with the release's fused input kernels, its unfused completion and its norm step)."""
    from sglang.srt.layers.layer_boundary import exit as exit_mod
    from sglang.srt.layers.layer_boundary import prepare
    from sglang.srt.layers.layer_boundary.fusions import allreduce
    from sglang.srt.layers.layer_boundary.output import UnreducedOutput
    from sglang.srt.layers.layer_boundary.residual.add_norm import NORM_READOUT

    batch = SimpleNamespace(input_ids=torch.zeros(tokens, dtype=torch.long),
                            residual_stream=SimpleNamespace(residual=None))
    facts = SimpleNamespace(single_sum=single_sum, fused_consumer_sum=True)
    defer = exit_mod._batch_allows_deferred_sum(batch, facts, None)
    hidden = UnreducedOutput(partial=partial, group=group) if defer else group.all_reduce(partial)
    step = functools.partial(prepare._update_read, pre_move=None, enters_stack=False, read=NORM_READOUT)
    fusions = allreduce.attn_input_fusions(SimpleNamespace(norm=norm, fusions=None))
    return defer, prepare._run_entry(hidden, residual, batch, norm, step=step, is_plain_add=True,
                                     carried_fusions=fusions)


@pytest.mark.parametrize("single_sum", [True, False], ids=["ordinary", "lora"])
@pytest.mark.parametrize("tokens,rows", [(4, 4), (4, 12), (12, 4), (12, 12)])  # the backend claims <= 8 tokens
def test_a_deferred_moe_sum_is_completed_exactly_once_whatever_the_inputs_rows(
        overlay, backend, moe_group, single_sum, tokens, rows):
    norm = rmsnorm()
    partial, residual = ints(rows, HIDDEN, seed=1), ints(rows, HIDDEN, seed=2)
    residual_before = residual.clone()
    defer, (out, res_out) = sglang_0523_moe_boundary(tokens, partial, residual, norm, moe_group,
                                                     single_sum=single_sum)
    assert defer is (single_sum or tokens <= 8)
    done = {"sglang": moe_group.all_reduce_calls, "fused": backend.stats["sm120_fused"],
            "claimed all-reduce": backend.group_coordinator.all_reduce_calls}
    assert sum(done.values()) == 1, done
    if defer and (rows <= 8 or not single_sum):  # ours: decided at the input, or the exit's claim honoured there
        assert done["fused" if rows <= 8 else "claimed all-reduce"] == 1, done
    ref_out, ref_res = reference((partial.float() * WORLD).to(partial.dtype), residual_before, norm)
    assert torch.equal(res_out, ref_res)
    torch.testing.assert_close(out, ref_out, atol=0.05, rtol=0.02)
    assert hooks_fusion._claim is None


@pytest.mark.parametrize("single_sum", [True, False], ids=["ordinary", "lora"])
def test_fused_moe_boundary_runs_at_most_ten_predicates_of_ours(overlay, backend, moe_group, single_sum):
    from benchmarks.bench_hot_path import predicates

    norm = rmsnorm()

    def boundary():
        sglang_0523_moe_boundary(4, ints(4, HIDDEN), ints(4, HIDDEN), norm, moe_group, single_sum=single_sum)

    assert predicates(boundary)["overlay"] <= 10
    assert backend.stats["sm120_fused"] == 2


# ---------------------------------------------------------------------------------------------------------
# pre-capture hook and byte bound


def fake_runner(draft=False, rows=32):
    return SimpleNamespace(
        model_runner=SimpleNamespace(
            server_args=SimpleNamespace(),
            model_config=SimpleNamespace(hidden_size=7168),
            dtype=torch.bfloat16,
            is_draft_worker=draft,
        ),
        _widest_decode_rows=lambda: rows,
    )


@pytest.fixture
def fusion_off_in_exec(monkeypatch):
    from sglang.srt.model_executor.runner import base_runner

    exec_bag = SimpleNamespace(comm=SimpleNamespace(flashinfer_allreduce_fusion_backend=None))
    monkeypatch.setattr(base_runner, "get_exec", lambda: exec_bag)


def test_pre_capture_seam_builds_from_sglangs_row_count(overlay, fusion_off_in_exec, monkeypatch):
    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    calls = []
    monkeypatch.setattr(hooks_distributed, "prepare_tp_backend",
                        lambda sa, hidden, dtype, decode_rows: calls.append((hidden, dtype, decode_rows)))
    monkeypatch.setattr(hooks_distributed, "sglang_group", lambda name: SimpleNamespace(sm120_backend=None))
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(fake_runner(rows=32))
    assert calls == [(7168, torch.bfloat16, 32)]
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(fake_runner(draft=True, rows=4))
    assert calls == [(7168, torch.bfloat16, 32)]  # a draft runner never sizes the workspace


@pytest.mark.parametrize("explicit,rows,expected", [
    (None, 32, 32 * 7168 * 2),
    (None, 4096, (8 << 20) // (7168 * 2) * 7168 * 2),  # capped, whole rows
    (None, None, 64 * 7168 * 2),  # no captured decode graph: the fixed fallback
    (123456, 32, 123456),
])
def test_byte_bound_from_decode_rows(monkeypatch, explicit, rows, expected):

    from sglang_sm120.core.config import OverlaySettings

    backend = fake_backend()
    backend.workspace = None
    backend.settings = OverlaySettings(mode="on", max_bytes=explicit)
    built = []
    monkeypatch.setattr(backend, "build", lambda hidden, dtype, bound, **kw: built.append(bound) or False)
    monkeypatch.setattr(hooks_distributed, "sglang_group", lambda name: SimpleNamespace(sm120_backend=backend))
    # 0.5.23's ServerArgs has no cuda_graph_max_bs; the speculative fields must not multiply SGLang's rows again
    server_args = SimpleNamespace(speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4)
    hooks_distributed.prepare_tp_backend(server_args, 7168, torch.bfloat16, decode_rows=rows)
    assert len(built) == 1 and built[0].max_bytes == expected, built


# ---------------------------------------------------------------------------------------------------------
# SGLang's own PCIe-IPC all-reduce


class FakeUpstreamPcieIpc:
    disabled = False

    def __init__(self):
        self.prepared = []

    def should_pcie_ipc_ar(self, inp):
        return True

    def prepare(self, *, hidden, max_rows=None):
        self.prepared.append((hidden, max_rows))


def coordinator(backend, upstream):
    """What SGLang's dispatcher and warm-up read of a GroupCoordinator."""
    return SimpleNamespace(sm120_backend=backend, pcie_ipc_comm=upstream, ca_comm=None, qr_comm=None,
                           pymscclpp_comm=None, torch_symm_mem_comm=None, pynccl_comm=None, unique_name="tp:0")


def upstream_method(group, inp):
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator._resolve_outplace_all_reduce_method(group, inp)


def test_ours_enabled_sets_upstream_aside_so_sglang_neither_builds_nor_uses_it(monkeypatch, caplog):
    from sglang.srt.model_executor.runner import base_runner

    backend, upstream = fake_backend(), FakeUpstreamPcieIpc()
    group = coordinator(backend, upstream)
    x = ints(2, HIDDEN)
    assert upstream_method(group, x) == "pcie_ipc"  # what SGLang would do without us
    with caplog.at_level("INFO", logger="sglang_sm120"):
        assert upstream_pcie.set_aside_upstream(group)
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE" in caplog.text
    assert group.pcie_ipc_comm is None and upstream_method(group, x) is None
    monkeypatch.setattr(base_runner, "get_parallel", lambda: SimpleNamespace(tp_group=group))
    base_runner.BaseRunner._pre_initialize_pcie_ipc_workspace(fake_runner())
    assert upstream.prepared == []  # its workspace is never built
    assert not upstream_pcie.restore_upstream_if_ours_failed(group)  # ours is built: stays aside


def test_ours_failing_to_build_hands_the_group_back_to_upstream(monkeypatch):
    from sglang.srt.model_executor.runner import base_runner

    backend, upstream = fake_backend(), FakeUpstreamPcieIpc()
    group = coordinator(backend, upstream)
    upstream_pcie.set_aside_upstream(group)
    backend.workspace, backend.build_attempted, backend.build_error = None, True, "test"
    assert upstream_pcie.restore_upstream_if_ours_failed(group)
    assert group.pcie_ipc_comm is upstream
    monkeypatch.setattr(base_runner, "get_parallel", lambda: SimpleNamespace(tp_group=group))
    base_runner.BaseRunner._pre_initialize_pcie_ipc_workspace(fake_runner(rows=32))
    assert upstream.prepared == [(7168, 32)]


def test_pre_capture_hook_hands_back_when_preparing_raised(overlay, fusion_off_in_exec, monkeypatch):
    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    backend, upstream = fake_backend(), FakeUpstreamPcieIpc()
    backend.workspace = None  # gate on, nothing built yet
    group = coordinator(backend, upstream)
    upstream_pcie.set_aside_upstream(group)
    monkeypatch.setattr(hooks_distributed, "sglang_group", lambda name: group)

    def broken_rows():
        raise RuntimeError("no decode config")

    runner = fake_runner()
    runner._widest_decode_rows = broken_rows
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(runner)
    assert group.pcie_ipc_comm is upstream


def test_ours_disabled_leaves_upstream_untouched(monkeypatch):
    upstream = FakeUpstreamPcieIpc()

    def original_init(self, name):
        self.unique_name, self.pcie_ipc_comm = name, upstream

    init = hooks_distributed.wrap_group_init_with_upstream_pcie(original_init)
    for gate_enabled in (None, False):
        if gate_enabled is None:
            monkeypatch.setattr(hooks_distributed, "attach", lambda g: None)  # mode off, or not a TP group
        else:
            off = fake_backend()
            off.decision = SimpleNamespace(enabled=False, reason="test")
            monkeypatch.setattr(hooks_distributed, "attach", lambda g, off=off: off)
        group = SimpleNamespace()
        init(group, "tp:0")
        assert group.pcie_ipc_comm is upstream
        assert not hasattr(group, upstream_pcie.SET_ASIDE_ATTR)
    on = fake_backend()
    monkeypatch.setattr(hooks_distributed, "attach", lambda g: on)
    group = SimpleNamespace()
    init(group, "tp:0")
    assert group.pcie_ipc_comm is None and getattr(group, upstream_pcie.SET_ASIDE_ATTR) is upstream


@pytest.mark.parametrize("value,expected", [(None, False), ("1", True), ("true", True), ("0", False)])
def test_upstream_pcie_ipc_requested_reads_sglangs_variable(monkeypatch, value, expected):
    monkeypatch.setenv(upstream_pcie.ENV, "")
    monkeypatch.delenv(upstream_pcie.ENV)
    if value is not None:
        monkeypatch.setenv(upstream_pcie.ENV, value)
    assert upstream_pcie.upstream_pcie_ipc_requested() is expected


def test_invalid_value_answers_as_sglang_acts_on_it(monkeypatch):
    from sglang.srt.distributed.device_communicators.pcie_ipc_ar import eligible_group

    monkeypatch.setenv(upstream_pcie.ENV, "maybe")
    with pytest.warns(UserWarning):
        sglang_builds_it = eligible_group(group_name="tp", world_size=2, deterministic=False)
    with pytest.warns(UserWarning):  # SGLang warns and uses the default: its path stays off
        assert upstream_pcie.upstream_pcie_ipc_requested() is sglang_builds_it is False
