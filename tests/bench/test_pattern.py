"""The verify-forward pattern generator (benchmarks/workloads/verify_pattern.py): counts, positions, EAGLE-3 capture
rule."""

from __future__ import annotations

import json

import pytest

from benchmarks.workloads import verify_pattern as vp


@pytest.fixture(scope="module")
def kimi():
    return vp.load_config("kimi_k25")


def comm_ops(ops):
    return [op for op in ops if op.is_comm]


def test_kimi_config_dimensions(kimi):
    assert kimi.hidden_size == 7168
    assert kimi.num_layers == 61
    assert kimi.first_k_dense == 1
    assert kimi.eagle3_capture_layers == (2, 30, 58)
    assert kimi.bytes_per_token == 14336
    assert not kimi.is_moe_layer(0) and kimi.is_moe_layer(1) and kimi.is_moe_layer(60)


def test_kimi_without_capture_123_allreduces_121_fused(kimi):
    ops = vp.build_verify_pattern(kimi, fuse=True, eagle3_capture=False)
    s = vp.summarize_pattern(ops)
    assert s["n_allreduce"] == 123
    assert s["n_fused"] == 121
    assert s["n_plain"] == 2
    # plain: the embedding (first) and the last layer's MoE output (last)
    assert s["plain_allreduce_indices"] == [0, 122]
    assert s["plain_allreduce_sites"] == ["embedding@-1", "mlp@60"]
    assert s["n_aux_capture"] == 0
    assert s["n_separate_add_rmsnorm"] == 1  # only the final norm


def test_kimi_with_eagle3_capture_layers_not_deferred(kimi):
    ops = vp.build_verify_pattern(kimi, fuse=True, eagle3_capture=True)
    s = vp.summarize_pattern(ops)
    assert s["n_allreduce"] == 123
    assert s["n_fused"] == 118
    assert s["n_plain"] == 5
    assert s["plain_allreduce_sites"] == ["embedding@-1", "mlp@1", "mlp@29", "mlp@57", "mlp@60"]
    assert s["n_aux_capture"] == 3
    # each capture: plain MLP all-reduce of layer i-1, then the capture, then layer i's separate input norm
    for i in (2, 30, 58):
        k = ops.index(vp.Op(vp.AUX_CAPTURE, i))
        assert ops[k - 1] == vp.Op(vp.ALLREDUCE, i - 1, "mlp")
        assert ops[k + 1] == vp.Op(vp.ADD_RMSNORM, i, "", "input_layernorm", i)
    # every other layer boundary is fused into the next layer's input norm
    fused_into = {op.norm_layer for op in ops if op.kind == vp.ALLREDUCE_ADD_RMSNORM and op.site == "mlp"}
    assert fused_into == set(range(1, 61)) - {2, 30, 58}


def test_unfused_pattern_is_nccl_path(kimi):
    ops = vp.build_verify_pattern(kimi, fuse=False, eagle3_capture=True)
    s = vp.summarize_pattern(ops)
    assert s["n_allreduce"] == 123 and s["n_fused"] == 0 and s["n_plain"] == 123
    # every all-reduce except the embedding's is followed (possibly after a capture) by one add+RMSNorm
    assert s["n_separate_add_rmsnorm"] == 122
    assert s["n_aux_capture"] == 3


def test_same_comm_sequence_both_paths(kimi):
    """Both backends reduce the same tensors in the same order; only the fusion differs."""
    f = [(op.layer, op.site) for op in comm_ops(vp.build_verify_pattern(kimi, fuse=True))]
    u = [(op.layer, op.site) for op in comm_ops(vp.build_verify_pattern(kimi, fuse=False))]
    assert f == u


def test_op_order_is_layer_by_layer(kimi):
    ops = vp.build_verify_pattern(kimi)
    assert ops[0] == vp.Op(vp.ALLREDUCE, -1, "embedding")
    assert [op.kind for op in ops].count(vp.RMSNORM) == 1
    att = [op.layer for op in ops if op.kind == vp.ATTENTION]
    mlp = [(op.layer, op.site) for op in ops if op.kind == vp.MLP]
    assert att == list(range(61))
    assert mlp == [(0, "dense")] + [(i, "moe") for i in range(1, 61)]
    # an attention or MLP compute is always followed by the all-reduce of its partial
    for k, op in enumerate(ops):
        if op.kind in (vp.ATTENTION, vp.MLP):
            assert ops[k + 1].is_comm and ops[k + 1].layer == op.layer
    assert ops[-1] == vp.Op(vp.ADD_RMSNORM, 60, "", "final_norm", 61)
    assert all(op.kind in vp.OP_KINDS for op in ops)


@pytest.mark.parametrize("num_layers", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("capture", [(), (0,), (1,), (0, 1, 2), (2, 4, 7)])
def test_counts_general(num_layers, capture):
    capture = tuple(c for c in capture if c < num_layers)
    cfg = vp.ModelConfig(name="t", hidden_size=64, num_layers=num_layers, first_k_dense=num_layers,
                         eagle3_capture_layers=capture)
    s = vp.summarize_pattern(vp.build_verify_pattern(cfg, fuse=True, eagle3_capture=True))
    not_deferred = sum(1 for c in capture if 1 <= c <= num_layers - 1)
    assert s["n_allreduce"] == 2 * num_layers + 1
    assert s["n_fused"] == 2 * num_layers - 1 - not_deferred
    assert s["n_fused"] + s["n_plain"] == s["n_allreduce"]
    assert s["n_aux_capture"] == len(capture)
    s0 = vp.summarize_pattern(vp.build_verify_pattern(cfg, fuse=True, eagle3_capture=False))
    assert s0["n_fused"] == 2 * num_layers - 1


def test_llama3_70b_second_example():
    cfg = vp.load_config("llama3_70b")
    assert cfg.moe is None and cfg.first_k_dense == cfg.num_layers == 80
    s = vp.summarize_pattern(vp.build_verify_pattern(cfg, eagle3_capture=False))
    assert (s["n_allreduce"], s["n_fused"]) == (161, 159)
    s = vp.summarize_pattern(vp.build_verify_pattern(cfg))
    assert (s["n_allreduce"], s["n_fused"], s["n_plain"]) == (161, 156, 5)
    assert all(op.site == "dense" for op in vp.build_verify_pattern(cfg) if op.kind == vp.MLP)


def test_all_shipped_configs_load():
    names = vp.available_configs()
    assert {"kimi_k25", "llama3_70b", "tiny_test"} <= set(names)
    for n in names:
        cfg = vp.load_config(n)
        assert cfg.to_dict()["name"] == n
        vp.build_verify_pattern(cfg)


def test_tiny_test_config_for_gpu_test():
    cfg = vp.load_config("tiny_test")
    assert (cfg.num_layers, cfg.hidden_size) == (4, 1024)
    s = vp.summarize_pattern(vp.build_verify_pattern(cfg))
    assert (s["n_allreduce"], s["n_fused"], s["n_plain"]) == (9, 6, 3)


def test_config_from_path_and_errors(tmp_path):
    d = json.loads((vp.CONFIG_DIR / "kimi_k25.json").read_text())
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({**d, "name": "mine"}))
    assert vp.load_config(str(p)).name == "mine"
    with pytest.raises(FileNotFoundError, match="available"):
        vp.load_config("no_such_model")
    with pytest.raises(ValueError):
        vp.config_from_dict({**d, "eagle3_capture_layers": [61]})
    with pytest.raises(ValueError):
        vp.config_from_dict({**d, "moe": None})  # MoE layers without a moe section


def test_expected_active_experts():
    assert vp.expected_active_experts(1, 384, 8) == 8
    vals = [vp.expected_active_experts(t, 384, 8) for t in (1, 2, 4, 8, 16, 32, 64, 128, 1024)]
    assert vals == sorted(vals) and vals[-1] <= 384
    assert 270 <= vp.expected_active_experts(64, 384, 8) <= 300
    assert vp.expected_active_experts(10_000, 384, 8) == 384


def test_gemm_shapes_kimi_tp8(kimi):
    sh = vp.gemm_shapes(kimi, 4, 8)
    att = sh["attn"]
    assert att["type"] == "mla"
    assert att["qkv_a"] == (4, 7168, 1536 + 512 + 64)
    assert att["q_b"] == (4, 1536, 8 * 192)
    assert att["o_proj"] == (4, 8 * 128, 7168)
    assert sh["dense"] == {"gate_up": (4, 7168, 2 * 18432 // 8), "down": (4, 18432 // 8, 7168)}
    moe = sh["moe"]
    assert moe["expert_down"][2:] == (2048 // 8, 7168)
    assert moe["active_experts"] * moe["rows_per_expert"] >= 4 * 8
    assert moe["shared_down"] == (4, 256, 7168)
    with pytest.raises(ValueError, match="divisible"):
        vp.gemm_shapes(kimi, 4, 3)


def test_gemm_shapes_gqa():
    cfg = vp.load_config("llama3_70b")
    sh = vp.gemm_shapes(cfg, 2, 8)
    assert sh["attn"] == {"type": "gqa", "qkv": (2, 8192, (8 + 2) * 128), "o_proj": (2, 8 * 128, 8192)}
    assert "moe" not in sh


def test_sglang_capture_layers_as_deepseek_sets_them():
    assert vp.sglang_capture_layers(61) == (2, 30, 58)  # no ids in the draft's eagle_config
    assert vp.sglang_capture_layers(61, [1, 29, 57]) == (2, 30, 58)  # ids of the layers whose output is read
    assert vp.sglang_capture_layers(61, [2, 30, 58]) == (2, 30, 58)
    assert vp.sglang_capture_layers(9, [0, 4, 6]) == (0, 4, 6)


@pytest.mark.parametrize("release, fused, plain, deferred", [("0.5.13.post1", 118, 5, 56), ("0.5.23", 121, 2, 59)])
def test_verify_counts_of_kimi_k25(kimi, release, fused, plain, deferred):
    counts = vp.verify_counts(kimi.num_layers, kimi.first_k_dense, vp.sglang_capture_layers(kimi.num_layers), release)
    assert counts == {"allreduce": 123, "fused": fused, "plain": plain, "moe_deferred": deferred, "draft_plain": 3}


@pytest.mark.parametrize("num_layers", [1, 2, 4, 9, 61])
@pytest.mark.parametrize("first_k_dense", [0, 1, 3])
@pytest.mark.parametrize("capture", [(), (1,), (0, 2), (2, 4, 6)])
def test_verify_counts_match_the_op_list(num_layers, first_k_dense, capture):
    """0.5.13.post1 is the op list with the capture guard, 0.5.23 the op list without it; the deferred MoE sums
    are the fused MLP boundaries of MoE layers."""
    first_k_dense = min(first_k_dense, num_layers)
    capture = tuple(c for c in capture if c < num_layers)
    cfg = vp.ModelConfig(name="t", hidden_size=64, num_layers=num_layers, first_k_dense=first_k_dense,
                         eagle3_capture_layers=capture, moe={"num_experts": 4, "top_k": 2, "intermediate_size": 8})
    for release, guard in (("0.5.13.post1", True), ("0.5.23", False)):
        ops = vp.build_verify_pattern(cfg, fuse=True, eagle3_capture=guard)
        s = vp.summarize_pattern(ops)
        moe_fused = sum(op.kind == vp.ALLREDUCE_ADD_RMSNORM and op.site == "mlp" and cfg.is_moe_layer(op.layer)
                        for op in ops)
        counts = vp.verify_counts(num_layers, first_k_dense, capture, release)
        assert (counts["allreduce"], counts["fused"], counts["plain"], counts["moe_deferred"]) == \
            (s["n_allreduce"], s["n_fused"], s["n_plain"], moe_fused)


def test_verify_counts_refuses_an_unknown_release():
    with pytest.raises(ValueError, match="0.5.13.post1"):
        vp.verify_counts(9, 1, (2, 4, 6), "0.5.20")
