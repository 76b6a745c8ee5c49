"""Building one group's workspace, host side (the device side is csrc/workspace.cu): every rank's slab in its own GPU
reached by the peers over CUDA IPC, or every rank's slab in one shared, pinned host-memory buffer; and the launch
limits every rank agrees on. Every step is one exchange.agree round; a rank that fails frees what it built first.
Rounds: device memory 2 (allocation with the launch limits; opening the peers); host memory 2 + W (creation by rank
0, mapping by the others, each with the launch limits; pinning, one rank at a time).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets

import torch

from . import _ext, cluster_check
from .errors import IpcAllReduceHostMemoryError
from .exchange import agree, attempt
from .policy import CLUSTER_SIZES, Memory
from .settings import VARIABLES, KernelSettings

logger = logging.getLogger(__name__)


def validate_islands(islands, world_size: int) -> list[list[int]] | None:
    """A caller's island partition, normalised; None for 'no islands' (None or one island: the flat schedules).
    Islands partition range(world_size) into groups of one size (the schedule pairs position i of every island)."""
    if islands is None or len(islands) <= 1:
        return None
    parts = [list(map(int, island)) for island in islands]
    if sorted(r for island in parts for r in island) != list(range(world_size)):
        raise ValueError(f"islands {parts} must partition the ranks 0..{world_size - 1} exactly once")
    if len({len(island) for island in parts}) != 1:
        raise ValueError(f"islands {parts} must all have the same size")
    return parts


def placement(islands: list[list[int]], rank: int) -> tuple[list[int], list[int], int, int]:
    """(ranks of my island by position, my twin in each island by island, my island, my position)."""
    for index, members in enumerate(islands):
        if rank in members:
            position = members.index(rank)
            return list(members), [island[position] for island in islands], index, position
    raise ValueError(f"rank {rank} is in no island of {islands}")


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
        return (self.device_index, self.rank, self.world_size, self.max_numel, self.oneshot_max_numel, self.timeout_s,
                self.warn_after_s, self.trap_on_timeout, *flat, *isl, self.memory.code,
                self.shm_dir if self.memory is Memory.HOST else "", shared_name, shared_create)


# Ends both the size check's error and that of an allocation that ran out of space (csrc/workspace.cu names sizes).
SHM_ADVICE = ("enlarge it (docker run --shm-size=1g; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm) "
              f"or point {VARIABLES['shm_dir']} at a larger tmpfs")


def shm_room(ops, world_size: int, max_numel: int, oneshot_max_numel: int, folder: str) -> tuple[int, int]:
    """(bytes the host-memory workspace needs, bytes free in the tmpfs `folder`)."""
    stat = os.statvfs(folder)
    return int(ops.host_shared_bytes_for(world_size, max_numel, oneshot_max_numel)), stat.f_bavail * stat.f_frsize


def host_file_name(ops, config: Config, settings: KernelSettings) -> str:
    """Before anything is allocated: the tmpfs has room for the whole host-memory workspace (else
    IpcAllReduceHostMemoryError naming the folder, its free space and the size needed); a fresh name for its shared
    file (rank 0's is used)."""
    try:
        need, free = shm_room(ops, config.world_size, config.max_numel, config.oneshot_max_numel, config.shm_dir)
    except Exception as exc:
        raise IpcAllReduceHostMemoryError(f"host memory: checking the free space of {config.shm_dir}: "
                                          f"{type(exc).__name__}: {exc}") from exc
    if free < need and not settings.debug_shm_no_precheck:
        raise IpcAllReduceHostMemoryError(
            f"host memory: {config.shm_dir} has {free / 2**20:.1f} MiB free, the workspace needs "
            f"{need / 2**20:.1f} MiB ({config.world_size} slabs of {need / config.world_size / 2**20:.1f} MiB); "
            + SHM_ADVICE)
    return f"sgl_sm120_{os.getpid()}_{secrets.token_hex(6)}"


def local_launch_limits(ops, handle: int, device_index: int, settings: KernelSettings) -> dict:
    """This rank's SM count, cluster capacities and cached cluster-check verdict (cluster_check.py: a workspace never
    runs the check; without a verdict it launches no clusters)."""
    capacity = [int(c) for c in ops.ws_cluster_capacity(handle)]
    verdict = cluster_check.ClusterVerdict(False, "the GPU reports no cluster capacity", "checked")
    if any(capacity):
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        verdict = cluster_check.cached_verdict(uuid, _ext.library_path(), settings)
    return {"sm": int(ops.ws_sm_count(handle)), "capacity": capacity, "clusters_ok": verdict.ok,
            "reason": verdict.reason}


def agree_launch_limits(every_rank: list[dict]) -> dict:
    """The launch limits every rank uses, a pure function of every rank's own: the smallest SM count and, per cluster
    size, the smallest capacity, 0 for every size unless every rank's cluster check passed. A group mixing two SKUs
    thus launches one grid shape everywhere."""
    clusters_ok = all(entry["clusters_ok"] for entry in every_rank)
    capacity = [min(entry["capacity"][i] for entry in every_rank) if clusters_ok else 0
                for i in range(len(CLUSTER_SIZES))]
    reasons = sorted({f"rank {r}: {entry['reason']}" for r, entry in enumerate(every_rank)
                      if not entry["clusters_ok"]})
    return {"sm_budget": min(entry["sm"] for entry in every_rank), "capacity": capacity,
            "clusters": [c for c, cap in zip(CLUSTER_SIZES, capacity, strict=True) if cap > 0],
            "reason": "; ".join(reasons) if reasons else every_rank[0]["reason"]}


def build(ops, exchange, config: Config, settings: KernelSettings, shared_name: str = "") -> tuple[int, dict]:
    """Collective: (this rank's workspace mapped to every peer's with the group's limits installed, the limits)."""
    handle = 0

    def create(shared_create: bool = False) -> dict:
        nonlocal handle
        try:
            handle = int(ops.ws_create(*config.create_args(shared_name, shared_create)))
        except torch.cuda.OutOfMemoryError as exc:  # the library's type for a tmpfs that filled up since the check
            sentence = str(exc).splitlines()[0].removeprefix("sgl_kernel_sm120: ")
            raise IpcAllReduceHostMemoryError(f"{sentence}; {SHM_ADVICE}") from exc
        limits = local_launch_limits(ops, handle, config.device_index, settings)
        if config.memory is Memory.DEVICE:
            limits["ipc"] = bytes(ops.ws_ipc_handle(handle).tolist()).hex()
        return limits

    try:
        if config.memory is Memory.DEVICE:
            every_rank = agree(exchange, "workspace allocation", *attempt(create))
            if config.world_size > 1:
                handles = torch.tensor([list(bytes.fromhex(entry["ipc"])) for entry in every_rank], dtype=torch.uint8)
                agree(exchange, "opening peer IPC handles", *attempt(lambda: ops.ws_open_peers(handle, handles)))
        else:
            # Rank 0 creates the file (sparse) and fills its slab, then every other rank fills its own
            # (posix_fallocate: a full tmpfs is a named error there, never a SIGBUS later).
            first = agree(exchange, "host-memory workspace creation",
                          *attempt(lambda: create(True) if config.rank == 0 else None))
            rest = agree(exchange, "host-memory workspace mapping",
                         *attempt(lambda: create() if config.rank != 0 else None))
            every_rank = first[:1] + rest[1:]
            for turn in range(config.world_size):  # pinning one rank at a time, the order every run passed with
                agree(exchange, f"pinning the host-memory workspace (rank {turn})",
                      *attempt(lambda turn=turn: ops.ws_register_shared(handle) if config.rank == turn else None))
            # Every rank has the buffer pinned; only the name is left in the folder. After the last round, so a
            # failure here is a warning: it must not end rank 0's construction while its peers go on.
            try:
                if config.rank == 0:
                    ops.ws_unlink_shared(handle)
            except Exception as exc:
                logger.warning("sgl_kernel_sm120: removing the host-memory workspace's file %s/%s failed (%s: %s); "
                               "the workspace works, remove the file by hand once the server stops", config.shm_dir,
                               shared_name, type(exc).__name__, exc)
        agreed = agree_launch_limits(every_rank)
        ops.ws_set_launch_limits(handle, agreed["sm_budget"], agreed["capacity"])
    except Exception:
        if handle:
            ops.ws_destroy(handle)
        raise
    return handle, agreed
