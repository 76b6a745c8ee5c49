"""PCIe/NUMA topology of the GPUs of a TP group, and the islands the 8-rank kernel schedule uses.

The probe asks NVML, for every pair of GPUs, for their closest common ancestor in the PCIe tree
(`nvmlDeviceGetTopologyCommonAncestor`: same board, same switch, switch hierarchy, host bridge, same CPU
socket, across sockets), plus each GPU's NUMA node. `islands_from_levels` is a pure function from that
matrix to islands: groups of ranks that are closer to each other than to anyone else. On the usual
two-socket box (GPUs 0-3 on one root complex, 4-7 on the other) that yields two islands of four; the
kernel then reduces inside each island, crosses the socket link once and broadcasts back.

Islands come from the probe, never from `rank // 4`: CUDA and NVML order GPUs differently, and
CUDA_VISIBLE_DEVICES can interleave sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# nvmlGpuTopologyLevel_t values, ordered from closest to farthest.
LEVEL_NAMES = {
    0: "SELF/BOARD",  # NVML_TOPOLOGY_INTERNAL: same board (multi-GPU card)
    10: "PIX",  # NVML_TOPOLOGY_SINGLE: one PCIe switch
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE: several PCIe switches, no host bridge
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE: same host bridge
    40: "NODE",  # NVML_TOPOLOGY_NODE: same NUMA node / CPU socket, different host bridges
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM: across sockets (SMP interconnect)
}

Level = int | None  # None: unknown


@dataclass
class Topology:
    uuids: list[str]
    levels: list[list[Level]] | None  # pairwise, diagonal 0
    numa_nodes: list[int | None]
    nvlink_all_pairs: bool | None  # None: unknown
    pci_bus_ids: list[str | None] = field(default_factory=list)
    error: str | None = None

    @property
    def link(self) -> str:
        """The `link` argument for sgl_kernel_sm120.IpcAllReduce ("auto" lets the kernel probe itself)."""
        return link_type(self.nvlink_all_pairs)

    def islands(self) -> list[list[int]] | None:
        return islands_from_levels(self.levels, self.numa_nodes)


def link_type(nvlink_all_pairs: bool | None) -> str:
    if nvlink_all_pairs is None:
        return "auto"
    return "nvlink" if nvlink_all_pairs else "pcie"


def level_name(level: Level) -> str:
    return "?" if level is None else LEVEL_NAMES.get(level, str(level))


def _equal_groups(labels: Sequence[object]) -> list[list[int]] | None:
    """Group indices by label; return the groups if there are at least two, all of one size >= 2."""
    groups: dict[object, list[int]] = {}
    for index, label in enumerate(labels):
        groups.setdefault(label, []).append(index)
    ordered = sorted(groups.values(), key=lambda members: members[0])
    sizes = {len(members) for members in ordered}
    if len(ordered) >= 2 and len(sizes) == 1 and min(sizes) >= 2:
        return ordered
    return None


def islands_from_levels(
    levels: Sequence[Sequence[Level]] | None, numa_nodes: Sequence[int | None] | None = None
) -> list[list[int]] | None:
    """Split the ranks where the topology splits at its top level; None means "treat as flat".

    Ranks joined by any link closer than the farthest level present form one island (connected components).
    The split is used only if it yields >= 2 islands of equal size >= 2. Uniform matrices (every pair behind
    one switch, or every pair across sockets as some VMs report) carry no structure: then the NUMA nodes
    decide, with the same equal-size rule. Unknown entries fall back to NUMA, then to flat.
    """
    n = len(levels) if levels is not None else len(numa_nodes or [])
    if n < 4:
        return None
    known = (
        levels is not None
        and len(levels) == n
        and all(len(row) == n for row in levels)
        and all(levels[i][j] is not None for i in range(n) for j in range(n) if i != j)
    )
    if known:
        off_diagonal = {int(levels[i][j]) for i in range(n) for j in range(n) if i != j}
        top = max(off_diagonal)
        if len(off_diagonal) > 1:
            parent = list(range(n))

            def find(x: int) -> int:
                while parent[x] != x:
                    parent[x] = parent[parent[x]]
                    x = parent[x]
                return x

            for i in range(n):
                for j in range(i + 1, n):
                    # Treat the matrix as symmetric: join if either direction reports a closer link.
                    if min(int(levels[i][j]), int(levels[j][i])) < top:
                        parent[find(i)] = find(j)
            split = _equal_groups([find(i) for i in range(n)])
            if split is not None:
                return split
            return None  # structured but irregular (e.g. 3 + 5): flat is the safe schedule
    if numa_nodes is not None and len(numa_nodes) == n and all(node is not None and node >= 0 for node in numa_nodes):
        return _equal_groups(list(numa_nodes))
    return None


def kernel_islands(islands: list[list[int]] | None, world_size: int) -> list[list[int]] | None:
    """The islands to hand to the kernel: its island schedule is for 8 ranks in two islands of four."""
    if world_size == 8 and islands is not None and len(islands) == 2 and all(len(i) == 4 for i in islands):
        return islands
    return None


# ---------------------------------------------------------------------------------------------------------
# NVML probe


def _nvml():
    import pynvml  # nvidia-ml-py; SGLang depends on it

    pynvml.nvmlInit()
    return pynvml


def probe(uuids: Sequence[str]) -> Topology:
    """Pairwise levels, NUMA nodes and NVLink connectivity of the GPUs with these UUIDs (NVML indexes GPUs
    in its own order, independent of CUDA_VISIBLE_DEVICES, hence UUIDs). Never raises: unknowns are None."""
    n = len(uuids)
    topo = Topology(list(uuids), None, [None] * n, None, [None] * n)
    try:
        nvml = _nvml()
    except Exception as exc:
        topo.error = f"NVML unavailable ({type(exc).__name__}: {exc})"
        return topo
    try:
        handles = [nvml.nvmlDeviceGetHandleByUUID(uuid) for uuid in uuids]
        levels: list[list[Level]] = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                try:
                    levels[i][j] = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
                except Exception:
                    levels[i][j] = None
        topo.levels = levels
        for i, handle in enumerate(handles):
            topo.numa_nodes[i] = _numa_node(nvml, handle)
            try:
                bus = nvml.nvmlDeviceGetPciInfo(handle).busId
                topo.pci_bus_ids[i] = bus.decode() if isinstance(bus, bytes) else str(bus)
            except Exception:
                pass
        nvlink: bool | None = True
        for i in range(n):
            for j in range(i + 1, n):
                try:
                    status = nvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], nvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    nvlink = nvlink and status == nvml.NVML_P2P_STATUS_OK
                except Exception:
                    nvlink = None
                    break
            if nvlink is None:
                break
        topo.nvlink_all_pairs = nvlink if n > 1 else None
    except Exception as exc:
        topo.error = f"NVML topology query failed ({type(exc).__name__}: {exc})"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return topo


def _numa_node(nvml, handle) -> int | None:
    try:
        node = int(nvml.nvmlDeviceGetNumaNodeId(handle))
        if node >= 0:
            return node
    except Exception:
        pass
    try:  # older drivers: ask sysfs through the PCI bus id
        bus = nvml.nvmlDeviceGetPciInfo(handle).busId
        bus = (bus.decode() if isinstance(bus, bytes) else str(bus)).lower()
        domain, rest = bus.split(":", 1)
        path = f"/sys/bus/pci/devices/{int(domain, 16):04x}:{rest}/numa_node"
        with open(path) as handle_file:
            node = int(handle_file.read().strip())
        return node if node >= 0 else None
    except Exception:
        return None


def cpu_affinity(uuid: str) -> str | None:
    """The CPU list NVML recommends for the GPU (e.g. "0-31,64-95"), for the doctor's report."""
    try:
        nvml = _nvml()
    except Exception:
        return None
    try:
        import os

        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        words = ((os.cpu_count() or 64) + 63) // 64
        mask = nvml.nvmlDeviceGetCpuAffinity(handle, max(1, words))
        cpus = [w * 64 + b for w, word in enumerate(mask) for b in range(64) if (int(word) >> b) & 1]
        return _ranges(cpus)
    except Exception:
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _ranges(values: list[int]) -> str:
    if not values:
        return ""
    out, start, prev = [], values[0], values[0]
    for v in values[1:]:
        if v == prev + 1:
            prev = v
            continue
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = v
    out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


def format_levels(levels: Sequence[Sequence[Level]] | None, labels: Sequence[str]) -> str:
    if levels is None:
        return "(unknown)"
    width = max(6, *(len(label) for label in labels))
    lines = [" " * width + "".join(f"{label:>{width}}" for label in labels)]
    for i, row in enumerate(levels):
        cells = "".join(f"{('X' if i == j else level_name(v)):>{width}}" for j, v in enumerate(row))
        lines.append(f"{labels[i]:>{width}}{cells}")
    return "\n".join(lines)
