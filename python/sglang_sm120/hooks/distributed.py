"""Replacements for SGLang's distributed seams: GroupCoordinator init / all_reduce / destroy, and the
pre-capture hook of ModelRunner. Each factory takes the original attribute and returns its replacement; the
version's seam table (`seams/v*.py`) says where they go.

Patching the class methods (not the free `tensor_model_parallel_all_reduce`) matters: model code such as
`models/deepseek_v2.py` imports that free function by name, but every path ends in `GroupCoordinator.all_reduce`.

SGLang 0.5.23 (last section): the pre-capture hook moved to `BaseRunner` (self is the runner), and the batch
bound is SGLang's own row count `BaseRunner._widest_decode_rows()` (the old cuda_graph_max_bs / cuda_graph_bs
fields are gone); `GroupCoordinator.__init__` also builds SGLang's own PCIe-IPC communicator when asked to,
which ours sets aside (upstream_pcie.py says why).
"""

from __future__ import annotations

import functools
import logging

import torch

from ..core import config
from ..runtime.communicator import Sm120Communicator, activation_line
from ..runtime.registry import group_communicator, set_group_communicator
from . import upstream_pcie

logger = logging.getLogger("sglang_sm120")

TP_GROUP_NAME = "tp"


def runtime_server_args():
    """The ServerArgs of this scheduler process, or None (e.g. a bare `init_distributed_environment`).

    0.5.23 owns it in `runtime_context` (its `get_global_server_args()` only raises); 0.5.13.post1 has no
    runtime_context, only the global accessor. Either way this is the raw record the launcher pickled to the
    process, which carries our attributes."""
    try:
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        get_server_args = None
    if get_server_args is not None:
        try:
            return get_server_args()
        except Exception:  # not published yet in this process
            return None
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:
        return None


def default_store():
    """The store of the default process group (the one SGLang's `init_distributed_environment` made), which the
    backend's agreements run over; None before torch.distributed is set up."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # private API: degrade to SGLang's global TCP store when it moves
        # The accessor exists in every supported release (0.5.23 no longer has the module global).
        try:
            from sglang.srt.distributed.utils import get_global_tcp_store

            return get_global_tcp_store()
        except Exception:
            return None


def sglang_group(name: str):
    """SGLang's group coordinator `name` ("tp_group", "attn_tp_group", "moe_ep_group", "moe_tp_group") of this
    process, where SGLang looks it up itself: 0.5.23 keeps the groups in its runtime context (`get_parallel()`,
    which a model-owned context can swap, and which its parallel_state getters, deprecated for callers outside
    SGLang, only forward to); 0.5.13.post1 has the getters alone (its `get_tp_group` also honours
    PD-multiplexing's prefill group). Never the module globals. Raises before the groups exist."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        from sglang.srt.distributed import parallel_state

        return getattr(parallel_state, f"get_{name}")()
    return getattr(get_parallel(), name)


def tp_communicator() -> Sm120Communicator | None:
    try:
        tp = sglang_group("tp_group")
    except Exception:
        return None
    return group_communicator(tp) if tp is not None else None


def _is_tp_group(group) -> bool:
    return str(getattr(group, "unique_name", "")).split(":")[0] == TP_GROUP_NAME


def deterministic_inference(server_args) -> bool:
    """The resolved switch where SGLang resolves it (0.5.23: resolution can turn it on, e.g. for
    --rl-on-policy-target, by a declaration that leaves the raw field False), else the field (0.5.13.post1)."""
    if server_args is None:
        return False
    try:
        from sglang.srt.arg_groups.overrides import resolution_result
    except ImportError:
        return bool(getattr(server_args, "enable_deterministic_inference", False))
    return bool(resolution_result(server_args, "enable_deterministic_inference", False))


def attach(group) -> Sm120Communicator | None:
    """Resolve the gate for a freshly built TP GroupCoordinator and attach the backend (or nothing)."""
    if not _is_tp_group(group) or group.world_size <= 1:
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
    comm = Sm120Communicator.for_group(
        group,
        settings,
        deterministic=deterministic_inference(server_args),
        store=default_store(),
        upstream_note=upstream_pcie.activation_note,
    )
    comm.resolve_gate()
    return comm


def wrap_group_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        set_group_communicator(self, None)
        try:
            set_group_communicator(self, attach(self))
        except Exception:
            # attach() handles its own collective failures; reaching here is a bug. Say so loudly; this rank
            # stays on NCCL and the peers' agreement rounds time out into the same answer.
            logger.exception("sglang_sm120 [%s]: attaching the sm120 backend failed", getattr(self, "unique_name", "?"))

    return __init__


# Where SGLang keeps its "inside a torch.compile piecewise CUDA graph" flag, per release. The seam table of
# each version lists its location in READS, so activation fails if it moved again.
PIECEWISE_PROBES = (
    ("sglang.srt.compilation.piecewise_context_manager", "is_in_piecewise_cuda_graph"),  # 0.5.13.post1
    (
        "sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager",
        "is_in_tc_piecewise_cuda_graph",
    ),  # 0.5.23
)
_piecewise_probe = None


def _find_piecewise_probe():
    import importlib

    for module_name, name in PIECEWISE_PROBES:
        try:
            return getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            continue
    return None


def _in_piecewise_cuda_graph() -> bool:
    global _piecewise_probe
    if _piecewise_probe is None:
        probe = _find_piecewise_probe()
        if probe is None:
            # Not knowing is treated as "inside": SGLang's own path is always correct there, ours is not.
            logger.error("sglang_sm120: no piecewise-CUDA-graph probe in this SGLang (looked for %s); all-reduces "
                         "stay on SGLang's paths", ", ".join(f"{m}.{n}" for m, n in PIECEWISE_PROBES))

            def probe():
                return True
        _piecewise_probe = probe
    return bool(_piecewise_probe())


def _must_use_original(inp: torch.Tensor) -> bool:
    # torch.compile traces SGLang's custom ops; a piecewise CUDA graph splits at inplace_all_reduce. Both
    # rely on SGLang's own ops, so we stay out of them (the same answer on every rank: same code path).
    # 0.5.23's breakable prefill CUDA graphs are NOT excluded: they are plain stream captures cut at eager
    # break points (attention and the like, never an all-reduce); a call of ours between two break points is
    # captured like one in a decode graph. SGLang itself lets its FlashInfer fusion and its PCIe-IPC
    # all-reduce run there (neither gate asks `is_in_breakable_cuda_graph`), and the workspace is built in
    # the runner warm-up, before any capture. Reasoning in docs/overlay.md; GPU check in
    # tests/gpu/test_breakable_graph.py.
    return torch.compiler.is_compiling() or _in_piecewise_cuda_graph()


def wrap_group_all_reduce(original):
    @functools.wraps(original)
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        comm = group_communicator(self)
        if comm is None or comm.workspace is None:
            return original(self, input_)
        # Checked before SGLang's own dispatch on purpose: on NVLink machines SGLang enables
        # CustomAllReduceV2, which comes first there; with the backend on, eligible tensors are ours.
        route = None if _must_use_original(input_) else comm.takes(input_)
        if route is not None:
            return comm.all_reduce(input_, route)
        comm.stats["fallback"] += 1
        return original(self, input_)

    return all_reduce


def wrap_group_destroy(original):
    @functools.wraps(original)
    def destroy(self):
        comm = group_communicator(self)
        if comm is not None:
            comm.close()  # before the gloo group the workspace was built over goes away
            set_group_communicator(self, None)
        return original(self)

    return destroy


def fusion_groups_are(group) -> bool:
    """True when a fused call, whichever group it names (attention TP, or MoE EP/TP), reduces over `group`."""
    try:
        attn = sglang_group("attn_tp_group")
        try:
            # 0.5.23 names the group a deferred MoE sum is completed over (TP when EP x MoE-TP merge into it).
            from sglang.srt.layers.moe.utils import post_experts_reduction_group
        except ImportError:
            post_experts_reduction_group = None
        if post_experts_reduction_group is not None:
            moe = post_experts_reduction_group()
        else:
            ep = sglang_group("moe_ep_group")
            moe = ep if ep.world_size > 1 else sglang_group("moe_tp_group")
        return attn is group and moe is group
    except Exception:
        return False


def prepare_tp_backend(
    server_args, hidden_size: int, dtype: torch.dtype, decode_rows: int | None = None
) -> Sm120Communicator | None:
    """Build the TP group's workspace (collective; every TP rank must call it at the same point).
    `decode_rows`: rows of the widest captured decode/verify reduction, where SGLang computes it (0.5.23);
    otherwise the bound is derived from the server arguments."""
    group = sglang_group("tp_group")
    comm = group_communicator(group)
    if comm is None or not comm.gate_enabled or comm.build_attempted:
        return comm
    settings = comm.settings  # parsed once, when the group was attached
    element_size = torch.empty((), dtype=dtype).element_size()
    bound = config.resolve_max_bytes(
        settings.max_bytes, server_args, hidden_size, element_size, decode_rows=decode_rows
    )
    timeout_s, _ = config.kernel_timeout_s(server_args)
    if comm.build(hidden_size, dtype, bound, kernel_timeout_s=timeout_s, tune=settings.tune):
        comm.fusion_groups_ok = fusion_groups_are(group)
        if not comm.fusion_groups_ok and comm.rank_in_group == 0:
            logger.info("sglang_sm120 [%s]: attention-TP/MoE groups differ from the TP group; fused "
                        "all-reduce+RMSNorm stays with SGLang, plain all-reduces use sm120", comm.name)
    return comm


def wrap_pre_capture(original):
    """ModelRunner._pre_initialize_flashinfer_allreduce_workspace: runs on every rank just before CUDA-graph
    capture, for the target and the draft model runner; the first call builds the workspace."""

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
# SGLang 0.5.23: the runner's pre-capture hook, and SGLang's own PCIe-IPC all-reduce beside ours


def wrap_group_init_with_upstream_pcie(original):
    """The shared GroupCoordinator.__init__ hook (gate agreement for the TP group), then the coexistence rule
    with SGLang's PCIe-IPC all-reduce."""
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
    """BaseRunner._pre_initialize_flashinfer_allreduce_workspace: runs once per model runner in its warm-up,
    before any CUDA graph of that runner is captured, on every rank, and before SGLang's own PCIe-IPC step."""

    @functools.wraps(original)
    def _pre_initialize_flashinfer_allreduce_workspace(self):
        result = original(self)
        model_runner = self.model_runner
        # The first build is final (captured graphs keep its pointers), so it is sized from the target
        # model's widest decode/verify reduction, never from a draft model's narrower one. The draft warms up
        # after the target; if it ever came first it would simply run on NCCL until the target builds.
        if getattr(model_runner, "is_draft_worker", False):
            return result
        failed = False
        try:
            prepare_tp_backend(
                model_runner.server_args,
                int(model_runner.model_config.hidden_size),
                model_runner.dtype,
                decode_rows=self._widest_decode_rows(),
            )
        except Exception:
            failed = True  # same inputs on every rank, so every rank fails here together
            logger.exception("sglang_sm120: preparing the sm120 workspace failed; all-reduces stay on NCCL")
        try:
            upstream_pcie.restore_upstream_if_ours_failed(sglang_group("tp_group"), failed=failed)
        except Exception:
            logger.exception("sglang_sm120: handing the TP group back to SGLang's PCIe-IPC all-reduce failed")
        return result

    return _pre_initialize_flashinfer_allreduce_workspace
