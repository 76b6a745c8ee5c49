"""Replacements for the fused all-reduce + residual-add + RMSNorm boundary (0.5.13.post1 names below; 0.5.23's
gate is `layers.layer_boundary...flashinfer_ar_fusion_applies`, same signature, see seams/v0_5_23.py).

The fusion gate `layers.communicator.apply_flashinfer_allreduce_fusion(T)` decides, per layer boundary, whether
the all-reduce is skipped at its source and done by `RMSNorm.forward_with_allreduce_fusion` at the next norm,
which calls the module function `layers.layernorm._forward_with_allreduce_fusion`. Both are looked up as module
globals at call time, so replacing the module attributes takes effect.

Three upstream hazards are guarded here:
 (a) EAGLE-3 captures `hidden_states + residual` before layer i as an auxiliary hidden state. If layer i-1
     deferred its MoE all-reduce into layer i's norm, that sum is an un-reduced partial. Layers feeding a
     captured layer are marked and never defer (`wrap_set_eagle3_layers`, `wrap_should_fuse_mlp`).
 (b) Upstream returns the norm of the un-reduced input when its fused op declines after the gate said yes.
     Once our gate said yes we never decline: if the kernel cannot take the call we all-reduce and norm.
 (c) The fused path returns a fresh residual (aux capture keeps a reference to it); so does our fallback.
"""

from __future__ import annotations

import functools
import logging

import torch

from .distributed import tp_communicator

logger = logging.getLogger("sglang_sm120")

# Set on a LayerCommunicator whose layer output EAGLE-3 (or DFLASH) captures before the next layer.
KEEP_MLP_ALLREDUCE = "_sm120_keep_mlp_allreduce"


def fusion_backend():
    """The TP backend if it is built and fused calls (attention-TP or MoE group) all reduce over its group."""
    comm = tp_communicator()
    if comm is None or comm.workspace is None or not comm.fusion_groups_ok:
        return None
    return comm


def _dp_attention_enabled() -> bool:
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        return bool(is_dp_attention_enabled())
    except Exception:
        return False


def sm120_fusion_applies(num_tokens: int) -> bool:
    """Our half of the fusion gate: backend active, the token count fits the workspace, and the routes send a
    fused call of that size to our kernel (where a tuned table says NCCL + SGLang's add + RMSNorm won, SGLang
    keeps its own path). A pure function of T and build-time configuration, so every rank answers the same."""
    comm = fusion_backend()
    if comm is None or torch.compiler.is_compiling() or _dp_attention_enabled():
        return False
    return comm.fuses_rows(num_tokens)


def wrap_fusion_gate(original):
    @functools.wraps(original)
    def apply_flashinfer_allreduce_fusion(batch_size: int):
        if sm120_fusion_applies(batch_size):
            return True
        return original(batch_size)

    return apply_flashinfer_allreduce_fusion


def norm_matches_kernel(norm_module) -> bool:
    """The fused kernel computes round(x + r) and then (r * rsqrt(mean(r^2) + eps) * w) in fp32, rounded once:
    plain RMSNorm semantics. Variants with other numerics go through their own forward instead."""
    return (
        getattr(norm_module, "variance_size_override", None) is None
        and not getattr(norm_module, "cast_x_before_out_mul", False)
        and not getattr(norm_module, "fp32_residual", False)
        and getattr(norm_module, "override_orig_dtype", None) is None
        # 0.5.23: a norm that also quantizes its output for the next projection (RMSNorm.fuse_input_quant)
        # must hand that projection what its own forward produces.
        and getattr(norm_module, "_quant_linear", None) is None
        and hasattr(norm_module, "variance_epsilon")
    )


def replace_forward_with_allreduce_fusion(original):
    @functools.wraps(original)
    def _forward_with_allreduce_fusion(
        norm_module, x, residual, post_residual_addition, weight, use_attn_tp_group: bool = True
    ):
        # Calls our gate did not claim are upstream's business, unchanged.
        if residual is None or not sm120_fusion_applies(x.shape[0]):
            return original(norm_module, x, residual, post_residual_addition, weight, use_attn_tp_group)
        comm = fusion_backend()
        # From here on the call is ours: the caller skipped its all-reduce because the gate said yes.
        if post_residual_addition is not None:
            residual = residual + post_residual_addition  # fresh, so the fallback below needs no clone
            fresh_residual = True
        else:
            fresh_residual = False
        route = comm.takes_fused(x, residual, weight) if norm_matches_kernel(norm_module) else None
        if route is not None:
            return comm.all_reduce_add_rmsnorm(x, residual, weight, norm_module.variance_epsilon, route)
        # Hazard (b): never hand back an un-reduced norm. Reduce (sm120 plain kernel or NCCL, whichever the
        # dispatch picks) and norm with the module's own forward, which updates its inputs in place: give it
        # a residual copy so the caller's residual is not written (hazard (c)).
        comm.stats["fused_fallback"] += 1
        reduced = comm.group_coordinator.all_reduce(x)
        if not fresh_residual:
            residual = residual.clone()
        return norm_module.forward(reduced, residual, None)

    return _forward_with_allreduce_fusion


def mark_layers_feeding_captures(causal_lm) -> list[int]:
    """Mark the communicator of every layer whose output an aux hidden-state capture reads. Returns the
    marked layer indices."""
    model = getattr(causal_lm, "model", None)
    layers = getattr(model, "layers", None)
    captured = getattr(model, "layers_to_capture", None) or []
    if layers is None:
        return []
    marked = []
    for index in captured:
        previous = int(index) - 1
        if 0 <= previous < len(layers):
            communicator = getattr(layers[previous], "layer_communicator", None)  # None for PP-missing layers
            if communicator is not None:
                setattr(communicator, KEEP_MLP_ALLREDUCE, True)
                marked.append(previous)
    return marked


def wrap_set_layers_to_capture(original):
    """For DeepseekV2ForCausalLM.set_eagle3_layers_to_capture / set_dflash_layers_to_capture (Kimi-K2.5's
    wrapper delegates to them)."""

    @functools.wraps(original)
    def set_layers_to_capture(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        marked = mark_layers_feeding_captures(self)
        if marked:
            logger.info("sglang_sm120: layers %s feed aux hidden-state captures; their MLP all-reduce is never "
                        "deferred into the next layer", marked)
        return result

    return set_layers_to_capture


def wrap_should_fuse_mlp(original):
    @functools.wraps(original)
    def should_fuse_mlp_allreduce_with_next_layer(self, forward_batch) -> bool:
        fuse = original(self, forward_batch)
        if fuse and getattr(self, KEEP_MLP_ALLREDUCE, False) and fusion_backend() is not None:
            return False
        return fuse

    return should_fuse_mlp_allreduce_with_next_layer
