"""The one rule from what a group's ranks see to the workspace they build, and the build with its one fallback. A
server's ranks (runtime/backend.py) and a tune's (tuning/child.py) both go through here, so the tune measures the
workspace the server builds:
- CUDA P2P between every pair: device memory, islands from the PCIe/NUMA probe (the 8-rank island schedule);
- a pair without P2P: pinned host memory (no islands), or nothing under SGLANG_SM120_HOSTMEM=off;
- P2P reported but the data-path probe finds data not delivered (ACS redirection, a translating IOMMU): the same
  ranks again in pinned host memory, unless refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .config import HOSTMEM_ENV
from .topology import Topology, kernel_islands


@dataclasses.dataclass(frozen=True)
class Plan:
    memory: str  # "device" | "host"
    islands: list[list[int]] | None  # the kernel's islands (device memory only)
    link: str  # IpcAllReduce's link argument


class PlanRefused(RuntimeError):
    """The group cannot build a workspace of ours (P2P missing and host memory refused)."""


def plan(p2p: Sequence[Sequence[bool]] | None, hostmem: str, topology: Topology | None) -> Plan:
    """The workspace a group of len(p2p) ranks builds first (pure)."""
    world = len(p2p) if p2p is not None else 0
    if p2p is None or not all(all(row) for row in p2p):
        if hostmem == "off":
            raise PlanRefused(f"CUDA P2P is missing between some GPUs and {HOSTMEM_ENV}=off refuses the pinned "
                              "host-memory workspace")
        return Plan("host", None, "auto")
    if topology is None:
        return Plan("device", None, "auto")
    return Plan("device", kernel_islands(topology.islands(), world), topology.link)


def failure_of(exc: BaseException) -> dict[str, Any]:
    """One rank's failed construction as the group agrees on it, by the error's type, never its words: the error,
    the data-path probe's failed pairs (or None), and a too small tmpfs's sentence: folder, free, needed (or None)."""
    from sgl_kernel_sm120.errors import IpcAllReduceHostMemoryError, IpcAllReduceProbeError

    return {"error": f"{type(exc).__name__}: {exc}",
            "pairs": [list(p) for p in exc.pairs] if isinstance(exc, IpcAllReduceProbeError) else None,
            "tmpfs": exc.tmpfs if isinstance(exc, IpcAllReduceHostMemoryError) else None}


def detail(failed: dict[int, dict]) -> str:
    return "; ".join(f"rank {r}: {o['error']}" for r, o in sorted(failed.items()))


def probe_pairs(failed: dict[int, dict]) -> str:
    pairs = list(dict.fromkeys((s, r, w) for o in failed.values() for s, r, w in o.get("pairs") or []))
    shown = ", ".join(f"rank {s} -> rank {r} ({what})" for s, r, what in pairs[:16])
    return (shown + (f" (+{len(pairs) - 16} more)" if len(pairs) > 16 else "")) or "some pairs"


@dataclasses.dataclass
class Built:
    workspace: Any  # an IpcAllReduce, or None when the group has none
    plan: Plan  # what was built (host memory after a failed probe)
    note: str = ""  # why the memory differs from the plan's
    failure: str = ""  # why there is no workspace


def build(first: Plan, construct: Callable[[Plan], tuple[Any, dict[int, dict]]], hostmem: str) -> Built:
    """Collective: `construct(plan)` builds on every rank and returns (workspace or None, {rank: failure_of(...)} of
    the ranks that failed, the same dict on every rank); after a probe failure on every failed rank, once more in
    host memory (not under hostmem off). Every rank ends with a workspace or none does."""
    workspace, failed = construct(first)
    if not failed:
        return Built(workspace, first)
    failure = f"building the IPC workspace failed ({detail(failed)})"
    if first.memory == "device" and all(o.get("pairs") is not None for o in failed.values()):
        if hostmem == "off":
            return Built(None, first, failure=f"{failure}; the pinned host-memory workspace is not tried "
                                              f"({HOSTMEM_ENV}=off)")
        host = Plan("host", None, "auto")
        workspace, failed_host = construct(host)
        if failed_host:
            return Built(None, host, failure=f"{failure}; the retry in pinned host memory failed too "
                                             f"({detail(failed_host)})")
        return Built(workspace, host, note=f"the CUDA P2P data-path probe failed for {probe_pairs(failed)}")
    tmpfs = next((o["tmpfs"] for o in failed.values() if o.get("tmpfs")), None)
    return Built(None, first, failure=f"the pinned host-memory workspace does not fit: {tmpfs}" if tmpfs else failure)
