"""PCIe/NUMA topology of a TP group's GPUs, and the islands the 8-rank kernel schedule uses.

`probe` asks NVML for every pair's closest common ancestor in the PCIe tree and for each GPU's NUMA node;
`islands_from_levels` turns that into islands, ranks closer to each other than to anyone else. On the usual
two-socket box that is two islands of four: the kernel reduces inside each, crosses the socket link once and
broadcasts back. Islands come from the probe, never from `rank // 4`: CUDA and NVML order GPUs differently, and
CUDA_VISIBLE_DEVICES can interleave sockets.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

# nvmlGpuTopologyLevel_t, closest first: one board, one PCIe switch, several switches, one host bridge, one NUMA
# node (different host bridges), across sockets.
LEVEL_NAMES = {0: "SELF/BOARD", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

@dataclass
class Topology:
    levels: list[list[int | None]] | None  # pairwise, diagonal 0; None: unknown
    numa_nodes: list[int | None]
    nvlink_all_pairs: bool | None  # None: unknown
    error: str | None = None

    @property
    def link(self) -> str:
        """The `link` argument of sgl_kernel_sm120.IpcAllReduce ("auto": the kernel probes for itself)."""
        return "auto" if self.nvlink_all_pairs is None else "nvlink" if self.nvlink_all_pairs else "pcie"

    def islands(self) -> list[list[int]] | None:
        return islands_from_levels(self.levels, self.numa_nodes)


def _equal_groups(labels: Sequence[object]) -> list[list[int]] | None:
    """The indices grouped by label, if that makes at least two groups, all of one size >= 2."""
    groups = sorted([i for i, other in enumerate(labels) if other == label] for label in set(labels))
    sizes = {len(group) for group in groups}
    return groups if len(groups) >= 2 and len(sizes) == 1 and min(sizes) >= 2 else None


def islands_from_levels(levels: Sequence[Sequence[int | None]] | None,
                        numa_nodes: Sequence[int | None] | None = None) -> list[list[int]] | None:
    """Split the ranks where the topology splits at its top level; None means "treat as flat".

    Ranks joined by any link closer than the farthest level present (either direction) form one island. The split
    is used only if it yields >= 2 islands of equal size >= 2; a structured but irregular one (3 + 5) is flat. A
    uniform matrix (all behind one switch, or all across sockets as some VMs report) or one with unknown entries
    leaves it to the NUMA nodes, by the same equal-size rule.
    """
    n = len(levels) if levels is not None else len(numa_nodes or [])
    if n < 4:
        return None
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    if levels is not None and all(len(row) == n for row in levels) and None not in {levels[i][j] for i, j in pairs}:
        top = max(levels[i][j] for i, j in pairs)
        if any(levels[i][j] < top for i, j in pairs):
            reach = [{j for j in range(n) if i == j or min(levels[i][j], levels[j][i]) < top} for i in range(n)]
            for k in range(n):  # Warshall's closure: a rank reaches whatever the ranks it reaches do
                reach = [r | reach[k] if k in r else r for r in reach]
            return _equal_groups([min(r) for r in reach])
    if numa_nodes is not None and len(numa_nodes) == n and all(node is not None and node >= 0 for node in numa_nodes):
        return _equal_groups(numa_nodes)
    return None


def kernel_islands(islands: list[list[int]] | None, world_size: int) -> list[list[int]] | None:
    """The islands to hand to the kernel: its island schedule is for 8 ranks in two islands of four."""
    if world_size == 8 and islands is not None and len(islands) == 2 and all(len(i) == 4 for i in islands):
        return islands
    return None


def _or_none(call, *args):
    try:
        return call(*args)
    except Exception:
        return None


@contextlib.contextmanager
def _nvml():
    import pynvml  # nvidia-ml-py; SGLang depends on it

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        _or_none(pynvml.nvmlShutdown)


def probe(uuids: Sequence[str]) -> Topology:
    """Pairwise levels, NUMA nodes and NVLink of the GPUs with these UUIDs (NVML orders GPUs its own way, whatever
    CUDA_VISIBLE_DEVICES says). Never raises: unknowns are None."""
    n = len(uuids)
    topo, stage = Topology(None, [None] * n, None), "NVML unavailable"
    try:
        with _nvml() as nvml:
            stage = "NVML topology query failed"
            handles = [nvml.nvmlDeviceGetHandleByUUID(uuid) for uuid in uuids]
            ancestor = nvml.nvmlDeviceGetTopologyCommonAncestor
            levels = [[0 if i == j else _or_none(ancestor, a, b) for j, b in enumerate(handles)]
                      for i, a in enumerate(handles)]
            topo.levels = [[None if v is None else int(v) for v in row] for row in levels]
            topo.numa_nodes = [_numa_node(nvml, handle) for handle in handles]
            status = [_or_none(nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], nvml.NVML_P2P_CAPS_INDEX_NVLINK)
                      for i in range(n) for j in range(i + 1, n)]
            if n > 1 and None not in status:
                topo.nvlink_all_pairs = all(s == nvml.NVML_P2P_STATUS_OK for s in status)
    except Exception as exc:
        topo.error = f"{stage} ({type(exc).__name__}: {exc})"
    return topo


def _numa_node(nvml, handle) -> int | None:
    node = _or_none(nvml.nvmlDeviceGetNumaNodeId, handle)
    bus = getattr(_or_none(nvml.nvmlDeviceGetPciInfo, handle), "busId", None)
    if (node is None or int(node) < 0) and bus:  # older drivers: sysfs, through the PCI bus id
        domain, _, rest = (bus.decode() if isinstance(bus, bytes) else str(bus)).lower().partition(":")
        path = pathlib.Path(f"/sys/bus/pci/devices/{int(domain, 16):04x}:{rest}/numa_node")
        node = _or_none(lambda: int(path.read_text().strip()))
    return int(node) if node is not None and int(node) >= 0 else None


def cpu_affinity(uuid: str) -> str | None:
    """The CPU list NVML recommends for the GPU ("0-31,64-95"), for the doctor."""
    try:
        with _nvml() as nvml:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            words = nvml.nvmlDeviceGetCpuAffinity(handle, ((os.cpu_count() or 64) + 63) // 64)
    except Exception:
        return None
    cpus = [w * 64 + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1]
    runs = [[cpu for _, cpu in run] for _, run in groupby(enumerate(cpus), lambda pair: pair[1] - pair[0])]
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def format_levels(levels: Sequence[Sequence[int | None]] | None, labels: Sequence[str]) -> str:
    if levels is None:
        return "(unknown)"
    width = max(6, *map(len, labels))
    names = [["X" if i == j else "?" if v is None else LEVEL_NAMES.get(v, str(v)) for j, v in enumerate(row)]
             for i, row in enumerate(levels)]
    return "\n".join("".join(f"{cell:>{width}}" for cell in row) for row in [["", *labels]] + [
        [label, *cells] for label, cells in zip(labels, names, strict=False)])
