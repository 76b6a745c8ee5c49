"""Coexistence with SGLang's own PCIe all-reduce (0.5.23: `distributed/device_communicators/pcie_ipc_ar.py`,
FlashInfer's PcieIpcAllReduceWorkspace, opt-in with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1): when our gate is on, the
group's `pcie_ipc_comm` is set aside at `GroupCoordinator.__init__`, and handed back if ours then fails to build
(docs/overlay.md). Two IPC workspaces on the same ranks would cost memory, an extra autotuning pass over gloo at
start-up, and a second set of spinning kernels for reductions ours declines; ours also fuses the norm.
"""

from __future__ import annotations

import logging

from ..runtime.registry import group_backend
from .installed import find_module_spec

logger = logging.getLogger("sglang_sm120")

ENV = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
UPSTREAM_MODULE = "sglang.srt.distributed.device_communicators.pcie_ipc_ar"
# Where the set-aside upstream communicator waits on its GroupCoordinator.
SET_ASIDE_ATTR = "_sm120_set_aside_pcie_ipc_comm"


def upstream_pcie_ipc_requested() -> bool:
    """True when the operator asked SGLang for its own PCIe-IPC all-reduce and this SGLang has one (located, not
    imported). Reads the variable with SGLang's own parser, so the answer is the one SGLang acts on (for an
    invalid value SGLang warns and keeps its path off; so does this)."""
    try:
        if find_module_spec(UPSTREAM_MODULE) is None:
            return False
    except (ImportError, ValueError):
        return False
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.get())


def activation_note(enabled: bool) -> str:
    """What the activation line says about SGLang's own PCIe-IPC all-reduce when it was asked for: with ours
    enabled, ours takes the group and upstream's workspace is not built; with ours off, upstream's is used."""
    try:
        if not upstream_pcie_ipc_requested():
            return ""
    except Exception as exc:  # reading SGLang's env registry failed: say so rather than guess
        return f"; could not tell whether SGLang's own PCIe-IPC all-reduce was requested ({exc})"
    if enabled:
        return (f"; {ENV} is set too: the sm120 backend takes the TP group's all-reduces (it also fuses the "
                "residual-add + RMSNorm) and SGLang's PCIe-IPC workspace is not built")
    return f"; {ENV} is set: SGLang's own PCIe-IPC all-reduce is used"


def set_aside_upstream(group) -> bool:
    """After our gate resolved on `group`: take SGLang's PCIe-IPC communicator off it if ours is enabled.
    Returns True if it did. Every rank reaches the same answer (the gate is agreed)."""
    comm = group_backend(group)
    upstream = getattr(group, "pcie_ipc_comm", None)
    if comm is None or not comm.gate_enabled or upstream is None:
        return False
    setattr(group, SET_ASIDE_ATTR, upstream)
    group.pcie_ipc_comm = None
    if comm.rank_in_group == 0:
        logger.info(
            "sglang_sm120 [%s]: %s is set, but the sm120 backend is enabled on this group and takes its "
            "all-reduces (it also fuses residual-add + RMSNorm); FlashInfer's PCIe-IPC workspace is not built",
            comm.name, ENV,
        )
    return True


def restore_upstream_if_ours_failed(group, failed: bool = False) -> bool:
    """After our build attempt: if our workspace could not be built (or preparing it raised: `failed`), hand
    the group back to SGLang's PCIe-IPC communicator, before SGLang's own pre-capture step, which then builds
    it. Returns True if it did."""
    upstream = getattr(group, SET_ASIDE_ATTR, None)
    comm = group_backend(group)
    if upstream is None or comm is None or comm.active or not (comm.build_attempted or failed):
        return False
    group.pcie_ipc_comm = upstream
    delattr(group, SET_ASIDE_ATTR)
    if comm.rank_in_group == 0:
        logger.warning(
            "sglang_sm120 [%s]: the sm120 workspace was not built (%s); SGLang's FlashInfer PCIe-IPC all-reduce "
            "(%s) takes the group as it would without the overlay", comm.name, comm.build_error, ENV,
        )
    return True
