"""Replacements for the fused all-reduce + residual-add + RMSNorm boundary (0.5.13.post1 names below; 0.5.23's are
in seams/v0_5_23.py).

SGLang defers a sum at its source and completes it at the next norm (`_forward_with_allreduce_fusion`), asking the
fusion gate at both ends on two numbers (the batch's token count, the partial sum's rows). Here the claim is decided
once: the first yes (never while torch.compile traces) records `_claim`, which every ask honours until the next
fused norm call, within the same forward, takes it up and completes the sum exactly once whatever its rows
(docs/overlay.md, "The fused boundary is decided once", says why that never changes whether a sum is completed).

Three upstream hazards are guarded here:
 (a) EAGLE-3 (0.5.13.post1) captures `hidden_states + residual` before layer i. If layer i-1 deferred its MoE
     all-reduce into layer i's norm, the capture reads an un-reduced partial sum, so layers feeding a capture
     never defer (`wrap_set_layers_to_capture`, `wrap_should_fuse_mlp`).
 (b) Upstream returns the norm of the un-reduced input when its fused op declines after the gate said yes.
     A claimed call never declines: if the kernel cannot take it we all-reduce, then norm.
 (c) The fused path returns a fresh residual (the capture keeps a reference to it); so does our fallback.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

logger = logging.getLogger("sglang_sm120")

# Set on a LayerCommunicator whose layer output EAGLE-3 (or DFLASH) captures before the next layer.
KEEP_MLP_ALLREDUCE = "_sm120_keep_mlp_allreduce"

_NOT_SERVING = SimpleNamespace(fused_tokens=frozenset())
_serving = _NOT_SERVING  # the TP backend whose fused calls this module routes (serve()); no token count otherwise
_claim = None  # the backend that completes the sum of the next fused norm call; None: no claim of ours
# (x.shape, norm module) -> route or None. A norm's first call of a size is checked in full (_first_route); its
# later calls of that size are the same layer's tensors, whose dtype, device and layout SGLang does not change, and
# the kernel's own argument check stands behind them (an error, never a wrong sum).
_routes: dict = {}
_is_compiling = torch.compiler.is_compiling


def serve(backend) -> None:
    """Route fused calls through `backend` (None: no token count is ours). Its `fused_tokens`, set when its
    workspace was built and emptied when it closes, are the token counts a gate claims."""
    global _serving, _claim
    _serving, _claim = backend or _NOT_SERVING, None
    _routes.clear()


def wrap_norm_gate(original):
    """The gate a norm asks before completing a sum with the fused op (0.5.13.post1: every ask, the source's
    included, which `wrap_should_fuse_mlp` makes afresh; 0.5.23: the fused input kernels and
    `flashinfer_preserves_residual`): the claim's answer while one stands, else ours for the token counts our
    routes serve, else upstream's."""

    @functools.wraps(original)
    def gate(batch_size: int):
        global _claim
        if _claim is None:
            if _is_compiling() or batch_size not in _serving.fused_tokens:
                return original(batch_size)
            _claim = _serving
        return True

    return gate


def wrap_source_gate(original):
    """0.5.23's exit, deciding whether an FFN may leave its sum to the next layer's input: afresh on the batch's
    token count, and a yes is the claim that input honours."""

    @functools.wraps(original)
    def gate(batch_size: int):
        global _claim
        if _is_compiling() or batch_size not in _serving.fused_tokens:
            _claim = None
            return original(batch_size)
        _claim = _serving
        return True

    return gate


def norm_matches_kernel(norm) -> bool:
    """The fused kernel computes round(x + r), then r * rsqrt(mean(r^2) + eps) * w in fp32, rounded once: plain
    RMSNorm. Variants with other numerics (or 0.5.23's norm that quantizes its output for the next projection)
    take their own forward."""
    return (getattr(norm, "variance_size_override", None) is None and not getattr(norm, "cast_x_before_out_mul", False)
            and not getattr(norm, "fp32_residual", False) and getattr(norm, "override_orig_dtype", None) is None
            and getattr(norm, "_quant_linear", None) is None and hasattr(norm, "variance_epsilon"))


def _first_route(backend, norm, x, residual, weight):
    """The full check of a norm's first call of a size; memoized for sizes within the byte bound."""
    route = backend.fused_route_for(x, residual, weight) if norm_matches_kernel(norm) else None
    if x.numel() * x.element_size() <= backend.max_bytes:
        _routes[x.shape, norm] = route
    return route


def replace_forward_with_allreduce_fusion(original):
    @functools.wraps(original)
    def _forward_with_allreduce_fusion(norm, x, residual, post_residual_addition, weight, use_attn_tp_group=True):
        global _claim
        backend, _claim = _claim, None
        if backend is None:  # not our claim: upstream's own gate said yes
            return original(norm, x, residual, post_residual_addition, weight, use_attn_tp_group)
        if residual is None:  # nothing to add the sum to (SGLang's callers always pass one): sum, then norm
            backend.stats["fused_fallback"] += 1
            return norm.forward(backend.group_coordinator.all_reduce(x), None, post_residual_addition)
        fresh = post_residual_addition is not None
        if fresh:
            residual = residual + post_residual_addition
        try:
            route = _routes[x.shape, norm]
        except KeyError:
            route = _first_route(backend, norm, x, residual, weight)
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
    """0.5.13.post1's source: whether a layer leaves its MLP sum to the next layer's input norm. SGLang's own
    answer asks the gate on the batch's token count, afresh; while the layer defers, that answer is the claim
    the next norm honours. A layer feeding a capture keeps its all-reduce while ours fuses (hazard a)."""

    @functools.wraps(original)
    def should_fuse_mlp_allreduce_with_next_layer(self, forward_batch) -> bool:
        global _claim
        _claim = None
        if original(self, forward_batch) and not (getattr(self, KEEP_MLP_ALLREDUCE, False)
                                                  and _serving.fused_tokens):
            return True
        _claim = None  # nothing is deferred (or a capture keeps it here): no norm takes this answer up
        return False

    return should_fuse_mlp_allreduce_with_next_layer
