"""A whole group in THIS process, one workspace per rank on one GPU seeing the others'
slabs directly. On W streams or as W branches of one CUDA graph the ranks' kernels run concurrently, which processes
sharing a GPU never do (they time-slice), so a race in a protocol can show; each rank gets a W-th of the SMs and of
the cluster capacity. Issue eager calls call-major (every rank's call k before any rank's call k + 1): with lazy
module loading a kernel's first launch may wait for the whole context, and rank-major order then deadlocks until the
timeout. Graph replays are safe: a graph's kernels load when it is instantiated.
"""

from __future__ import annotations

import torch

from sgl_kernel_sm120 import _ext, construction
from sgl_kernel_sm120 import settings as switches
from sgl_kernel_sm120.errors import IpcAllReduceError
from sgl_kernel_sm120.ipc_allreduce import AUTO, IpcAllReduce
from sgl_kernel_sm120.policy import Link


def local_group(device, world_size: int, max_numel: int, dtype: torch.dtype = torch.bfloat16, *, islands=None,
                link: str = "pcie", timeout_s: float = 30.0, warn_after_s: float | None = None,
                on_timeout: str = "exit", transport: str = AUTO) -> list[IpcAllReduce]:
    """The group's workspaces, rank order; close them with close_local_group() (one alone is not closable)."""
    ops = _ext.ops()
    settings = switches.read()
    comms = []
    for rank in range(world_size):
        comm = IpcAllReduce.__new__(IpcAllReduce)
        comm.exchange, comm.rank, comm.world_size = None, rank, world_size
        comm._set_fields(device, max_numel, dtype, islands, link, "device", timeout_s, warn_after_s, on_timeout,
                         transport, settings)
        comm.link = Link(link) if link != AUTO else Link.PCIE
        comm.use_pdl = False  # W streams of one process: no programmatic edges between the ranks' launches
        comms.append(comm)
    try:
        for comm in comms:
            comm._handle = int(ops.ws_create(*comm._config().create_args()))
        ops.ws_link_local([c._handle for c in comms])
        local = construction.local_launch_limits(ops, comms[0]._handle, comms[0].device.index, settings)
        budget = local["sm"] // world_size
        if budget < 1:
            raise IpcAllReduceError(f"{world_size} ranks cannot be co-resident on {local['sm']} SMs")
        share = {**local, "sm": budget, "capacity": [c // world_size for c in local["capacity"]],
                 "reason": local["reason"] + f" (local group: a {world_size}th of the GPU per rank)"}
        agreed = construction.agree_launch_limits([share])
        for comm in comms:
            ops.ws_set_launch_limits(comm._handle, agreed["sm_budget"], agreed["capacity"])
            comm._start(ops, agreed)
    except Exception:
        close_local_group(comms)
        raise
    return comms


def close_local_group(comms: list[IpcAllReduce]) -> None:
    """Wait for the device, then free every rank's workspace (each maps the others' slabs, so they go together)."""
    for comm in comms:
        if comm._watchdog is not None:
            comm._watchdog.stop()
    try:
        torch.cuda.synchronize()
    finally:
        for comm in comms:
            comm._release()
