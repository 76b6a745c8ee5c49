"""Seam table for sglang 0.5.13.post1 (docs/overlay.md says why each entry is here).

Not patched, on purpose:
- `GroupCoordinator.graph_capture`: the kernel pushes its input into IPC scratch it owns and keeps its
  protocol state on the device, so captured calls need no buffer registration at capture end (unlike
  SGLang's custom all-reduce). Capture on the side stream and replay on another stream is fine because the
  two never run concurrently.
- `tensor_model_parallel_all_reduce` and friends: imported by name into model files; every one of them
  ends in `GroupCoordinator.all_reduce`, which is patched.
- `ServerArgs._handle_model_specific_adjustments`: FlashInfer's fusion auto-enable there is already limited
  to SM90/SM100; the `__post_init__` seam switches an explicit request off on SM12x.
"""

from __future__ import annotations

from ..hooks import distributed as dist_hooks
from ..hooks import fusion as fusion_hooks
from ..hooks import server_args as args_hooks
from ..hooks import server_info as info_hooks
from ..hooks import startup
from .base import Seam

SGLANG_VERSION = "0.5.13.post1"

# As in v0_5_23.py: what entrypoints/engine._set_envs_and_config sets before the ranks start (no graph register).
SERVER_NCCL = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}

SEAMS = [
    Seam("sglang.srt.server_args:ServerArgs.add_cli_args", args_hooks.wrap_add_cli_args),
    Seam("sglang.srt.server_args:ServerArgs.from_cli_args", args_hooks.wrap_from_cli_args),
    Seam("sglang.srt.server_args:ServerArgs.__post_init__", args_hooks.wrap_post_init),
    Seam("sglang.srt.entrypoints.engine:_set_envs_and_config", startup.wrap_set_envs_and_config),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.__init__", dist_hooks.wrap_group_init),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.all_reduce", dist_hooks.wrap_group_all_reduce),
    Seam("sglang.srt.distributed.parallel_state:GroupCoordinator.destroy", dist_hooks.wrap_group_destroy),
    Seam("sglang.srt.model_executor.model_runner:ModelRunner._pre_initialize_flashinfer_allreduce_workspace",
         dist_hooks.wrap_pre_capture),
    Seam("sglang.srt.layers.communicator:apply_flashinfer_allreduce_fusion", fusion_hooks.wrap_norm_gate),
    Seam("sglang.srt.layers.layernorm:_forward_with_allreduce_fusion",
         fusion_hooks.replace_forward_with_allreduce_fusion),
    Seam("sglang.srt.layers.communicator:LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer",
         fusion_hooks.wrap_should_fuse_mlp),
    Seam("sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM.set_eagle3_layers_to_capture",
         fusion_hooks.wrap_set_layers_to_capture),
    Seam("sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM.set_dflash_layers_to_capture",
         fusion_hooks.wrap_set_layers_to_capture),
    Seam("sglang.srt.managers.scheduler:Scheduler.get_internal_state", info_hooks.wrap_get_internal_state),
]

# Names the hooks read (not patched); activation fails naming any that is missing.
READS = [
    "sglang.srt.server_args:get_global_server_args",
    "sglang.srt.compilation.piecewise_context_manager:is_in_piecewise_cuda_graph",
    "sglang.srt.distributed.utils:get_global_tcp_store",
    "sglang.srt.distributed.parallel_state:get_tp_group",
    "sglang.srt.distributed.parallel_state:get_attn_tp_group",
    "sglang.srt.layers.dp_attention:is_dp_attention_enabled",
]
