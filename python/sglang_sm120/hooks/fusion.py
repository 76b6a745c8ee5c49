"""Replacements for the fused all-reduce + residual-add + RMSNorm boundary (0.5.13.post1 names below; 0.5.23's
gate is `layer_boundary...flashinfer_ar_fusion_applies`, same signature, see seams/v0_5_23.py).

The fusion gate decides, per layer boundary, whether the all-reduce is skipped at its source and done by
`RMSNorm.forward_with_allreduce_fusion` at the next norm, which calls the module function
`layers.layernorm._forward_with_allreduce_fusion`. Both are looked up as module globals at call time, so replacing
the module attributes takes effect.

Three upstream hazards are guarded here:
 (a) EAGLE-3 (0.5.13.post1) captures `hidden_states + residual` before layer i. If layer i-1 deferred its MoE
     all-reduce into layer i's norm, the capture reads an un-reduced partial sum, so layers feeding a capture
     never defer (`wrap_set_layers_to_capture`, `wrap_should_fuse_mlp`).
 (b) Upstream returns the norm of the un-reduced input when its fused op declines after the gate said yes.
     Once our gate said yes we never decline: if the kernel cannot take the call we all-reduce, then norm.
 (c) The fused path returns a fresh residual (the capture keeps a reference to it); so does our fallback.
"""

from __future__ import annotations

import functools
import logging

import torch

from .distributed import tp_backend

logger = logging.getLogger("sglang_sm120")

# Set on a LayerCommunicator whose layer output EAGLE-3 (or DFLASH) captures before the next layer.
KEEP_MLP_ALLREDUCE = "_sm120_keep_mlp_allreduce"


def fused_backend(num_tokens: int):
    """The TP backend when our gate says yes for `num_tokens` rows: built, fused calls reduce over its group, and
    its routes send a fused call of that size to our kernel (where a table says NCCL + SGLang's norm won, SGLang
    keeps its own path). A pure function of T and what was agreed at build, so every rank answers the same."""
    backend = tp_backend()
    if backend is None or num_tokens not in backend.fused_tokens or torch.compiler.is_compiling():
        return None
    return backend


def wrap_fusion_gate(original):
    @functools.wraps(original)
    def apply_flashinfer_allreduce_fusion(batch_size: int):
        return fused_backend(batch_size) is not None or original(batch_size)

    return apply_flashinfer_allreduce_fusion


def norm_matches_kernel(norm) -> bool:
    """The fused kernel computes round(x + r), then r * rsqrt(mean(r^2) + eps) * w in fp32, rounded once: plain
    RMSNorm. Variants with other numerics (or 0.5.23's norm that quantizes its output for the next projection)
    take their own forward."""
    return (getattr(norm, "variance_size_override", None) is None and not getattr(norm, "cast_x_before_out_mul", False)
            and not getattr(norm, "fp32_residual", False) and getattr(norm, "override_orig_dtype", None) is None
            and getattr(norm, "_quant_linear", None) is None and hasattr(norm, "variance_epsilon"))


def replace_forward_with_allreduce_fusion(original):
    @functools.wraps(original)
    def _forward_with_allreduce_fusion(norm, x, residual, post_residual_addition, weight, use_attn_tp_group=True):
        backend = fused_backend(x.shape[0]) if residual is not None else None
        if backend is None:  # a call our gate did not claim: upstream's, unchanged
            return original(norm, x, residual, post_residual_addition, weight, use_attn_tp_group)
        # From here on the call is ours: the caller skipped its all-reduce because our gate said yes.
        fresh = post_residual_addition is not None
        if fresh:
            residual = residual + post_residual_addition
        route = backend.fused_route_for(x, residual, weight) if norm_matches_kernel(norm) else None
        if route is not None:
            return backend.run_fused(x, residual, weight, norm.variance_epsilon, route)
        # Hazard (b): reduce (ours or NCCL, as the dispatch picks), then the module's own norm, which writes its
        # inputs: it gets a residual of its own (hazard (c)).
        backend.stats["fused_fallback"] += 1
        return norm.forward(backend.group_coordinator.all_reduce(x), residual if fresh else residual.clone(), None)

    return _forward_with_allreduce_fusion


def mark_layers_feeding_captures(causal_lm) -> list[int]:
    """Mark the communicator of every layer whose output an aux hidden-state capture reads; the marked indices."""
    model = getattr(causal_lm, "model", None)
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    marked = []
    for index in getattr(model, "layers_to_capture", None) or []:
        previous = int(index) - 1
        communicator = getattr(layers[previous], "layer_communicator", None) if 0 <= previous < len(layers) else None
        if communicator is not None:  # None for layers of another pipeline stage
            setattr(communicator, KEEP_MLP_ALLREDUCE, True)
            marked.append(previous)
    return marked


def wrap_set_layers_to_capture(original):
    """DeepseekV2ForCausalLM.set_eagle3_layers_to_capture / set_dflash_layers_to_capture (Kimi-K2.5's wrapper
    delegates to them)."""

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
        if fuse and getattr(self, KEEP_MLP_ALLREDUCE, False):
            backend = tp_backend()
            return backend is None or not backend.fused_tokens  # our fusion active: keep the reduce here
        return fuse

    return should_fuse_mlp_allreduce_with_next_layer
