"""Seam table for sglang 0.5.23 (the `layer_boundary/` layout; docs/overlay.md maps each 0.5.13.post1 seam onto it
and says why each entry is here).

Not patched, on purpose:
- `ServerArgs.__post_init__`: msgspec binds it when the struct class is built; a replacement never runs.
  `resolve_once` takes its job.
- `layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies`: it is defined there but only called
  through the copies that `fusions/allreduce.py` and `exit.py` import by name, which are patched. Patching the
  definition too would let a module imported later copy our wrapper, which restoring could then not undo.
- The should-fuse-MLP and EAGLE-3 capture-layer guards of 0.5.13.post1: a capture never reads a partial sum here.
  With `capture=` the owed sum is completed (plain) before capturing; with `capture_gathered=` (DeepSeek-V3 and
  Kimi-K2.5) the capture reads the residual after the fused input kernel completed the sum and added it
  (`StageBoundary._prepare_attention`), keeping our fresh `residual_out` by reference. So 0.5.23 fuses the
  boundaries feeding captures too.
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

_BOUNDARY = "sglang.srt.layers.layer_boundary"

SEAMS = [
    Seam("sglang.srt.server_args:ServerArgs.add_cli_args", args_hooks.wrap_add_cli_args,
         "adds the --sm120-allreduce* flags to SGLang's parser"),
    Seam("sglang.srt.server_args:ServerArgs.from_cli_args", args_hooks.wrap_from_cli_args,
         "stores the parsed flags on the ServerArgs record (pickled to every scheduler) before it is sealed"),
    Seam("sglang.srt.server_args:ServerArgs.resolve_once", args_hooks.wrap_resolve_once,
         "Engine API: settings from the environment, set before resolution seals the record"),
    Seam("sglang.srt.arg_groups.model_hook:handle_model_specific_adjustments",
         args_hooks.wrap_handle_model_specific_adjustments,
         "declares FlashInfer all-reduce fusion off on SM12x, after SGLang's own auto-enable/enforce-disable"),
    Seam("sglang.srt.entrypoints.engine:_set_envs_and_config", startup.wrap_set_envs_and_config,
         "in the launcher, before any rank starts: the tune when no routing table of this box exists (or forced)"),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.__init__",
         dist_hooks.wrap_group_init_with_upstream_pcie,
         "resolves the gate for the 'tp' group; sets SGLang's PCIe-IPC communicator aside when ours is enabled"),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.all_reduce", dist_hooks.wrap_group_all_reduce,
         "eligible tensors -> sm120 kernel, ahead of SGLang's own dispatch; the rest -> original"),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.destroy", dist_hooks.wrap_group_destroy,
         "releases the IPC workspace before the group's process groups go away"),
    Seam("sglang.srt.model_executor.runner.base_runner:BaseRunner._pre_initialize_flashinfer_allreduce_workspace",
         dist_hooks.wrap_runner_pre_capture,
         "builds the IPC workspace before capture, sized by SGLang's widest decode/verify row count"),
    Seam(f"{_BOUNDARY}.fusions.allreduce:flashinfer_ar_fusion_applies", fusion_hooks.wrap_norm_gate,
         "the gate the fused attention/FFN input kernels and flashinfer_preserves_residual call; it honours a "
         "claim of ours"),
    Seam(f"{_BOUNDARY}.exit:flashinfer_ar_fusion_applies", fusion_hooks.wrap_source_gate,
         "the same gate where an FFN exit decides whether a LoRA / TP1-shared-expert sum may be deferred: a "
         "yes is the claim the next input honours"),
    Seam("sglang.srt.layers.layernorm:_forward_with_allreduce_fusion",
         fusion_hooks.replace_forward_with_allreduce_fusion,
         "fused all-reduce + residual-add + RMSNorm through sm120; a call we claimed never declines"),
    Seam("sglang.srt.managers.scheduler:Scheduler.get_internal_state", info_hooks.wrap_get_internal_state,
         "adds the backend's state and device-side call counters to /get_server_info and /server_info"),
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
