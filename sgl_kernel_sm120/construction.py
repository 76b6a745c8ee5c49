"""Building one group's workspace, host side (the device side is csrc/workspace.cu): every rank's slab in its own
GPU reached by the peers over CUDA IPC, or every rank's slab in one shared, pinned host-memory buffer; then the
launch limits every rank agrees on.

Every step is collective over a CPU (gloo) group: each rank records its outcome, the outcomes are gathered and
every rank raises together if any rank failed (`joint_check`), so no rank is left waiting in a later collective
for a peer that gave up. A step that fails frees what this rank built before it raises.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets

import torch
import torch.distributed as dist

from . import _ext, cluster_check
from .env import setting
from .errors import IpcAllReduceError, IpcAllReduceHostMemoryError
from .policy import CLUSTER_SIZES, Memory

# Where the host-memory workspace's shared file lives: a tmpfs (/dev/shm by default).
SHM_DIR_ENV = "SGL_SM120_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"
SHM_ADVICE = (
    "enlarge it (docker run --shm-size=1g; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm) or "
    f"point {SHM_DIR_ENV} at a larger tmpfs"
)
# Tests only: skip the size check so that the allocation itself meets a full tmpfs (csrc/workspace.cu).
SHM_NO_PRECHECK_ENV = "SGL_SM120_DEBUG_SHM_NO_PRECHECK"
HOST_MEMORY_ERROR = "host memory:"  # how a failure of the host-memory workspace's size begins

logger = logging.getLogger(__name__)


def joint_check(group, local_error: str | None, step: str) -> None:
    """Gather every rank's outcome of `step`; raise the same error on every rank if any failed."""
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, local_error, group=group)
    failed = {r: e for r, e in enumerate(outcomes) if e}
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        # A host-memory workspace that does not fit its tmpfs gets its own type: the overlay names the folder.
        host_memory = any(HOST_MEMORY_ERROR in e for e in failed.values())
        kind = IpcAllReduceHostMemoryError if host_memory else IpcAllReduceError
        raise kind(f"IpcAllReduce {step} failed ({detail})")


def validate_islands(islands, world_size: int) -> list[list[int]] | None:
    """Check a caller-given island partition; returns it normalised, or None for 'no islands'.

    Islands must partition range(world_size) into at least two groups of equal size (the schedule pairs
    position i of every island). One island, or None, means the flat schedules only.
    """
    if islands is None:
        return None
    groups = [list(map(int, g)) for g in islands]
    if len(groups) <= 1:
        return None
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ValueError(f"islands {groups} must partition the ranks 0..{world_size - 1} exactly once")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"islands {groups} must all have the same size")
    return groups


def placement(groups: list[list[int]], rank: int) -> tuple[list[int], list[int], int, int]:
    """(ranks of my island by position, my twin in each island by island, my island, my position)."""
    for island, members in enumerate(groups):
        if rank in members:
            index = members.index(rank)
            twins = [g[index] for g in groups]
            return list(members), twins, island, index
    raise ValueError(f"rank {rank} is in no island of {groups}")


@dataclasses.dataclass(frozen=True)
class Config:
    """One rank's share of a workspace, as csrc/workspace.cu's WorkspaceConfig takes it (ws_create)."""

    device_index: int
    rank: int
    world_size: int
    max_numel: int
    oneshot_max_numel: int  # the one-shot slots are sized by it (<= max_numel)
    timeout_s: float
    warn_after_s: float
    trap_on_timeout: bool
    islands: list[list[int]] | None
    memory: Memory
    shm_dir: str = ""

    def create_args(self, shared_name: str = "", shared_create: bool = False) -> tuple:
        flat = placement([list(range(self.world_size))], self.rank)
        isl = placement(self.islands, self.rank) if self.islands else ([], [], 0, 0)
        return (
            self.device_index, self.rank, self.world_size, self.max_numel, self.oneshot_max_numel, self.timeout_s,
            self.warn_after_s, self.trap_on_timeout, *flat, *isl, self.memory.code,
            self.shm_dir if self.memory is Memory.HOST else "", shared_name, shared_create,
        )


def destroy(ops, handle: int) -> None:
    if handle:
        ops.ws_destroy(handle)


def create_device(ops, group, config: Config) -> int:
    """Collective: this rank's slab, then every peer's opened through its CUDA IPC handle. Returns the handle.

    Every step that can fail on one rank ends in a joint_check that all ranks reach: a rank that left between two
    collectives would leave its peers waiting in the next one for the group's own timeout (hours in SGLang)."""
    handle, error, ipc_handle = 0, None, None
    try:
        handle = int(ops.ws_create(*config.create_args()))
        ipc_handle = bytes(ops.ws_ipc_handle(handle).tolist())
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    try:
        joint_check(group, error, "workspace allocation")
        handles: list = [None] * config.world_size
        dist.all_gather_object(handles, ipc_handle, group=group)
        error = None
        if config.world_size > 1:
            try:
                ops.ws_open_peers(handle, torch.tensor([list(h) for h in handles], dtype=torch.uint8))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        joint_check(group, error, "opening peer IPC handles")
    except Exception:
        destroy(ops, handle)
        raise
    return handle


def create_host(ops, group, config: Config) -> int:
    """Collective: rank 0 creates the shared file (sparse, after checking the tmpfs has room for all of it) and
    allocates its own slab; then every other rank allocates its own (posix_fallocate: a full tmpfs is a named error
    on that rank, never a SIGBUS, csrc/workspace.cu); then every rank pins the whole buffer; once all have, rank 0
    removes the name, so nothing is left in the folder whatever happens later. Returns the handle."""
    error = None
    try:
        need = int(ops.host_shared_bytes_for(config.world_size, config.max_numel, config.oneshot_max_numel))
        stat = os.statvfs(config.shm_dir)
        free = stat.f_bavail * stat.f_frsize
        if free < need and setting(SHM_NO_PRECHECK_ENV) != "1":
            error = (f"{HOST_MEMORY_ERROR} {config.shm_dir} has {free / 2**20:.1f} MiB free, the workspace needs "
                     f"{need / 2**20:.1f} MiB ({config.world_size} slabs of "
                     f"{need / config.world_size / 2**20:.1f} MiB); {SHM_ADVICE}")
    except Exception as exc:
        error = f"{HOST_MEMORY_ERROR} checking the free space of {config.shm_dir}: {type(exc).__name__}: {exc}"
    joint_check(group, error, "host-memory workspace size check")
    names: list = [None] * config.world_size
    dist.all_gather_object(names, f"sgl_sm120_{os.getpid()}_{secrets.token_hex(6)}", group=group)
    handle = 0
    try:
        for creating in (True, False):
            error = None
            if (config.rank == 0) == creating:
                try:
                    handle = int(ops.ws_create(*config.create_args(names[0], creating)))
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            joint_check(group, error, "host-memory workspace " + ("creation" if creating else "mapping"))
        # One rank at a time, as every run that passed did. (The construction "hang" of 2026-12-02 first blamed on
        # all ranks pinning at once was rank 0 dying in the NUMA lookup, csrc/workspace.cu numa_node_of; pinning in
        # turn costs W small barriers at start-up and was kept.)
        for turn in range(config.world_size):
            error = None
            if config.rank == turn:
                try:
                    ops.ws_register_shared(handle)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            joint_check(group, error, f"pinning the host-memory workspace (rank {turn})")
        if config.rank == 0:
            # After the last joint step, on rank 0 only: a failure here must not end this rank's construction
            # while its peers go on into the next collective. Every rank has the buffer pinned; only the name stays.
            try:
                ops.ws_unlink_shared(handle)
            except Exception as exc:
                logger.warning("sgl_kernel_sm120: removing the host-memory workspace's file %s/%s failed (%s: %s);"
                               " the workspace works, remove the file by hand once the server stops",
                               config.shm_dir, names[0], type(exc).__name__, exc)
    except Exception:
        destroy(ops, handle)
        raise
    return handle


def local_launch_limits(ops, handle: int, device: torch.device) -> dict:
    """This rank's SM count, cluster capacities and cluster-check verdict (sgl_kernel_sm120/cluster_check.py)."""
    capacity = [int(c) for c in ops.ws_cluster_capacity(handle)]
    verdict = cluster_check.ClusterVerdict(False, "the GPU reports no cluster capacity", "checked")
    if any(capacity):
        verdict = cluster_check.verdict_for(device.index, str(torch.cuda.get_device_properties(device).uuid),
                                            _ext.library_path())
    return {"sm": int(ops.ws_sm_count(handle)), "capacity": capacity, "clusters_ok": verdict.ok,
            "reason": verdict.reason}


def agree_launch_limits(locals_: list[dict]) -> dict:
    """The launch limits every rank uses, from every rank's own (a pure function of the gathered list, so every
    rank gets the same): the smallest SM count, and per cluster size the smallest capacity, 0 for every size
    unless every rank's cluster check passed. A group mixing two SKUs thus launches one grid shape everywhere."""
    clusters_ok = all(entry["clusters_ok"] for entry in locals_)
    capacity = [min(entry["capacity"][i] for entry in locals_) if clusters_ok else 0
                for i in range(len(CLUSTER_SIZES))]
    reasons = sorted({f"rank {r}: {entry['reason']}" for r, entry in enumerate(locals_) if not entry["clusters_ok"]})
    return {
        "sm_budget": min(entry["sm"] for entry in locals_),
        "capacity": capacity,
        "clusters": [c for c, cap in zip(CLUSTER_SIZES, capacity, strict=True) if cap > 0],
        "reason": "; ".join(reasons) if reasons else locals_[0]["reason"],
    }


def install_launch_limits(ops, handle: int, group, world_size: int, device: torch.device) -> dict:
    """Collective: every rank's launch limits, agreed (agree_launch_limits) and installed in the workspace, so
    every rank launches the same grids. Returns the agreed limits."""
    error, local = None, None
    try:
        local = local_launch_limits(ops, handle, device)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    joint_check(group, error, "launch-limit check")
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, local, group=group)
    agreed = agree_launch_limits(everyone)
    ops.ws_set_launch_limits(handle, agreed["sm_budget"], agreed["capacity"])
    return agreed
