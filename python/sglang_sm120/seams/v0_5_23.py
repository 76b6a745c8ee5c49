"""Seam table for sglang 0.5.23 (the `layer_boundary/` layout); docs/overlay.md says why each entry is here, and
why the gate's definition and 0.5.13.post1's capture guards are not patched.

Not patched either, on purpose:
- `ServerArgs.__post_init__`: msgspec binds it when the struct class is built; a replacement never runs.
  `resolve_once` takes its job.
- `GroupCoordinator.graph_capture`: as for 0.5.13.post1 (see v0_5_13_post1.py).
- `BaseRunner._pre_initialize_pcie_ipc_workspace`: with SGLang's PCIe-IPC communicator set aside at group init
  (hooks/upstream_pcie.py) it finds nothing to build; patching it would miss the dispatcher's build-on-first-use.
"""

from __future__ import annotations

from ..hooks import distributed as dist_hooks
from ..hooks import fusion as fusion_hooks
from ..hooks import server_args as args_hooks
from ..hooks import server_info as info_hooks
from ..hooks import startup
from .base import Seam

SGLANG_VERSION = "0.5.23"

# The NCCL_* variables this release's launcher sets before its ranks start, where they are not set already
# (entrypoints/engine._set_envs_and_config without --enable-symm-mem or --enable-nccl-nvls, and
# arg_groups/parallel_hook for a TP server that captures CUDA graphs): the NCCL a server runs, which a tune run by
# hand measures (a table is keyed by every NCCL_* variable).
SERVER_NCCL = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_REGISTER": "0"}

_BOUNDARY = "sglang.srt.layers.layer_boundary"

SEAMS = [
    Seam("sglang.srt.server_args:ServerArgs.add_cli_args", args_hooks.wrap_add_cli_args),
    Seam("sglang.srt.server_args:ServerArgs.from_cli_args", args_hooks.wrap_from_cli_args),
    Seam("sglang.srt.server_args:ServerArgs.resolve_once", args_hooks.wrap_resolve_once),
    Seam("sglang.srt.arg_groups.model_hook:handle_model_specific_adjustments",
         args_hooks.wrap_handle_model_specific_adjustments),
    Seam("sglang.srt.entrypoints.engine:_set_envs_and_config", startup.wrap_set_envs_and_config),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.__init__",
         dist_hooks.wrap_group_init_with_upstream_pcie),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.all_reduce", dist_hooks.wrap_group_all_reduce),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.destroy", dist_hooks.wrap_group_destroy),
    Seam("sglang.srt.model_executor.runner.base_runner:BaseRunner._pre_initialize_flashinfer_allreduce_workspace",
         dist_hooks.wrap_runner_pre_capture),
    Seam(f"{_BOUNDARY}.fusions.allreduce:flashinfer_ar_fusion_applies", fusion_hooks.wrap_norm_gate),
    Seam(f"{_BOUNDARY}.exit:flashinfer_ar_fusion_applies", fusion_hooks.wrap_source_gate),
    Seam("sglang.srt.layers.layernorm:_forward_with_allreduce_fusion",
         fusion_hooks.replace_forward_with_allreduce_fusion),
    Seam("sglang.srt.managers.scheduler:Scheduler.get_internal_state", info_hooks.wrap_get_internal_state),
]

# Names the hooks read (not patched); activation fails naming any that is missing.
READS = [
    "sglang.srt.runtime_context:get_server_args",
    "sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager"
    ":is_in_tc_piecewise_cuda_graph",
    "sglang.srt.distributed.utils:get_global_tcp_store",
    "sglang.srt.runtime_context:get_parallel",
    "sglang.srt.layers.moe.utils:post_experts_reduction_group",
    "sglang.srt.layers.dp_attention:is_dp_attention_enabled",
    "sglang.srt.arg_groups.overrides:declare_resolution",
    "sglang.srt.arg_groups.overrides:resolution_result",
    "sglang.srt.utils.common:get_device_sm",
    "sglang.srt.environ:envs",
    "sglang.srt.distributed.device_communicators.pcie_ipc_ar:PcieIpcCommunicator",
]
