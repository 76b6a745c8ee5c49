"""Replacements for SGLang's distributed seams: GroupCoordinator init / all_reduce / destroy, and the pre-capture
hook of the model runner (0.5.23's, in the last section, is the runner's). The class methods are patched, not the
free `tensor_model_parallel_all_reduce`: model files import that function by name, but every path ends in
`GroupCoordinator.all_reduce`.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

from ..core import config
from ..runtime.backend import TPBackend, activation_line
from ..runtime.registry import ATTR, group_backend, set_group_backend
from . import fusion, upstream_pcie
from .startup import resolved

logger = logging.getLogger("sglang_sm120")


def runtime_server_args():
    """This process's ServerArgs record (0.5.23: the runtime context; 0.5.13.post1: the global), or None."""
    try:
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        from sglang.srt.server_args import get_global_server_args as get_server_args
    try:
        return get_server_args()
    except Exception:  # not published yet in this process
        return None


def default_store():
    """The store of the default process group (SGLang's `init_distributed_environment` made it), which the
    backend agrees over; None before torch.distributed is set up."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # a private API: SGLang's own accessor when it moves
        try:
            from sglang.srt.distributed.utils import get_global_tcp_store

            return get_global_tcp_store()
        except Exception:
            return None


_groups = None


def sglang_group(name: str):
    """SGLang's group coordinator `name` ("tp_group", "attn_tp_group", "moe_ep_group", "moe_tp_group") where SGLang
    looks it up itself: 0.5.23's runtime context (`get_parallel()`; its parallel_state getters only forward there
    and warn), 0.5.13.post1's getters. The module is found once: the fusion gate asks on every eager boundary."""
    global _groups
    if _groups is None:
        try:
            _groups = importlib.import_module("sglang.srt.runtime_context")
        except ImportError:
            _groups = importlib.import_module("sglang.srt.distributed.parallel_state")
    get_parallel = getattr(_groups, "get_parallel", None)
    return getattr(get_parallel(), name) if get_parallel is not None else getattr(_groups, f"get_{name}")()


def tp_backend() -> TPBackend | None:
    try:
        return group_backend(sglang_group("tp_group"))
    except Exception:  # the groups do not exist yet
        return None


def deterministic_inference(server_args) -> bool:
    """The resolved switch (0.5.23 may turn it on by a declaration that leaves the raw field False), else the
    field (0.5.13.post1)."""
    return server_args is not None and bool(resolved(server_args, "enable_deterministic_inference"))


def attach(group) -> TPBackend | None:
    """Resolve the gate for a freshly built TP GroupCoordinator and attach the backend (or nothing)."""
    if str(getattr(group, "unique_name", "")).split(":")[0] != "tp" or group.world_size <= 1:
        return None
    if getattr(group, "device", None) is None or group.device.type != "cuda":
        return None
    server_args = runtime_server_args()
    settings = config.settings_of(server_args)
    if settings.mode == "off":
        if group.rank_in_group == 0:
            logger.warning("%s", activation_line(False, group.unique_name, group.world_size, "off",
                                                 "mode off (--sm120-allreduce / SGLANG_SM120_ALLREDUCE)",
                                                 upstream_pcie.activation_note(False)))
        return None
    backend = TPBackend.for_group(group, settings, deterministic_inference(server_args), store=default_store(),
                                  upstream_note=upstream_pcie.activation_note)
    backend.resolve_gate()
    return backend


def wrap_group_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        set_group_backend(self, None)
        try:
            set_group_backend(self, attach(self))
        except Exception:  # attach() handles collective failures itself; reaching here is a bug, said loudly
            logger.exception("sglang_sm120 [%s]: attaching the sm120 backend failed", getattr(self, "unique_name", "?"))

    return __init__


# Where SGLang keeps its "inside a torch.compile piecewise CUDA graph" flag, per release (each table's READS
# names its own, so activation fails if it moved).
PIECEWISE_PROBES = (
    ("sglang.srt.compilation.piecewise_context_manager", "is_in_piecewise_cuda_graph"),  # 0.5.13.post1
    ("sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager",
     "is_in_tc_piecewise_cuda_graph"),  # 0.5.23
)
_in_piecewise = None
_is_compiling = torch.compiler.is_compiling


def _piecewise_probe():
    for module_name, name in PIECEWISE_PROBES:
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    # Not knowing counts as inside: SGLang's own path is always right there, ours is not.
    logger.error("sglang_sm120: no piecewise-CUDA-graph flag in this SGLang; all-reduces stay on SGLang's paths")
    return lambda: True


def must_use_original() -> bool:
    """torch.compile traces SGLang's own ops and a piecewise CUDA graph splits at its in-place all-reduce, so
    calls there stay SGLang's (the same answer on every rank). 0.5.23's breakable prefill graphs are plain stream
    captures cut at attention, never at an all-reduce, so ours run there (docs/overlay.md)."""
    global _in_piecewise
    if _in_piecewise is None:
        _in_piecewise = _piecewise_probe()
    return _is_compiling() or bool(_in_piecewise())


def wrap_group_all_reduce(original):
    @functools.wraps(original)
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        backend = getattr(self, ATTR, None)  # group_backend(self), one call less per all-reduce
        # Ahead of SGLang's own dispatch on purpose: on NVLink boxes SGLang's CustomAllReduceV2 comes first there.
        route = None if backend is None or must_use_original() else backend.route_for(input_)
        if route is not None:
            return backend.run(input_, route)
        if backend is not None and backend.active:
            backend.stats["fallback"] += 1
        return original(self, input_)

    return all_reduce


def wrap_group_destroy(original):
    @functools.wraps(original)
    def destroy(self):
        backend = group_backend(self)
        if backend is not None:
            fusion.serve(None)  # a process has one TP group, so this was the backend served
            backend.close()  # before the process groups the workspace was built over go
            set_group_backend(self, None)
        return original(self)

    return destroy


def fusion_reduces_over(group) -> bool:
    """True when a fused call, whichever group it names (attention TP, or the MoE output group), reduces over
    `group`, and DP attention is off: then the fused kernel's ranks are the group's."""
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        if is_dp_attention_enabled():
            return False
        try:  # 0.5.23 names the group a deferred MoE sum completes over
            from sglang.srt.layers.moe.utils import post_experts_reduction_group as moe_group
        except ImportError:
            def moe_group():
                ep = sglang_group("moe_ep_group")
                return ep if ep.world_size > 1 else sglang_group("moe_tp_group")
        return sglang_group("attn_tp_group") is group and moe_group() is group
    except Exception:
        return False


def prepare_tp_backend(server_args, hidden_size: int, dtype: torch.dtype,
                       decode_rows: int | None = None) -> TPBackend | None:
    """Build the TP group's workspace (collective: every TP rank calls it at the same point). `decode_rows`: the
    widest captured decode/verify reduction where SGLang computes it (0.5.23)."""
    group = sglang_group("tp_group")
    backend = group_backend(group)
    if backend is None or not backend.gate_enabled or backend.build_attempted:
        return backend
    settings = backend.settings
    bound = config.resolve_max_bytes(settings.max_bytes, server_args, hidden_size,
                                     dtype.itemsize, decode_rows=decode_rows)
    fusion_ok = fusion_reduces_over(group)
    draft_tokens = getattr(server_args, "speculative_num_draft_tokens", None)
    verify_rows = int(draft_tokens) if getattr(server_args, "speculative_algorithm", None) and draft_tokens else 1
    built = backend.build(hidden_size, dtype, bound, kernel_timeout_s=config.kernel_timeout_s(server_args),
                          tune=settings.tune, fusion_ok=fusion_ok, verify_rows=verify_rows)
    fusion.serve(backend)  # its fused token counts (none unless built with fusion_ok) are what the gates claim
    if built and not fusion_ok:
        backend._log_rank0(logging.INFO, f"sglang_sm120 [{backend.name}]: attention-TP/MoE groups differ from the TP "
                                         "group (or DP attention is on); the fused all-reduce + RMSNorm stays with "
                                         "SGLang, plain all-reduces use sm120")
    return backend


def wrap_pre_capture(original):
    """ModelRunner._pre_initialize_flashinfer_allreduce_workspace: on every rank right before CUDA-graph capture,
    for the target and the draft model runner; the first call builds the workspace."""

    @functools.wraps(original)
    def _pre_initialize_flashinfer_allreduce_workspace(self):
        result = original(self)
        try:
            prepare_tp_backend(self.server_args, int(self.model_config.hidden_size), self.dtype)
        except Exception:
            logger.exception("sglang_sm120: preparing the sm120 workspace failed; all-reduces stay on NCCL")
        return result

    return _pre_initialize_flashinfer_allreduce_workspace


# ---------------------------------------------------------------------------------------------------------
# SGLang 0.5.23


def wrap_group_init_with_upstream_pcie(original):
    """The gate for the TP group, then the coexistence rule with SGLang's PCIe-IPC all-reduce."""
    attach_init = wrap_group_init(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        attach_init(self, *args, **kwargs)
        try:
            upstream_pcie.set_aside_upstream(self)
        except Exception:
            logger.exception("sglang_sm120 [%s]: deciding between SGLang's PCIe-IPC all-reduce and ours failed",
                             getattr(self, "unique_name", "?"))

    return __init__


def wrap_runner_pre_capture(original):
    """BaseRunner._pre_initialize_flashinfer_allreduce_workspace: once per model runner in its warm-up, before its
    graphs are captured, on every rank, before SGLang's own PCIe-IPC step."""

    @functools.wraps(original)
    def _pre_initialize_flashinfer_allreduce_workspace(self):
        result = original(self)
        runner = self.model_runner
        # The first build is final (captured graphs keep its pointers), so it is sized by the target model's
        # widest reduction; the draft warms up after the target.
        if getattr(runner, "is_draft_worker", False):
            return result
        failed = False
        try:
            prepare_tp_backend(runner.server_args, int(runner.model_config.hidden_size), runner.dtype,
                               decode_rows=self._widest_decode_rows())
        except Exception:
            failed = True  # the same inputs on every rank: every rank fails here together
            logger.exception("sglang_sm120: preparing the sm120 workspace failed; all-reduces stay on NCCL")
        try:
            upstream_pcie.restore_upstream_if_ours_failed(sglang_group("tp_group"), failed=failed)
        except Exception:
            logger.exception("sglang_sm120: handing the TP group back to SGLang's PCIe-IPC all-reduce failed")
        return result

    return _pre_initialize_flashinfer_allreduce_workspace
