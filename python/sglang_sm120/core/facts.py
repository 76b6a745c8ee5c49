"""What one rank sees, as JSON: the gate's inputs and the rank's part of the routing-table key.

The gate round sends these once, at group creation, so every rank later holds every rank's part of the key without
another round. P2P is probed here, not taken from SGLang: SGLang runs its P2P test only after deciding that more
than two PCIe GPUs cannot use its custom all-reduce, i.e. never on the boxes this overlay is for.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

from . import nccl
from .gate import SM120

logger = logging.getLogger(__name__)


def node_identity() -> str:
    """The same for every process of one machine (containers included), different across machines."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return f"{socket.gethostname()}/{handle.read().strip()}"
    except OSError:
        return f"{socket.gethostname()}/"


def gpu_uuid(props) -> str:
    uuid = str(getattr(props, "uuid", ""))
    return uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"


def _index(device) -> int:
    import torch

    return device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()


def kernel_error() -> str | None:
    """None when sgl_kernel_sm120's compiled kernels load, else why not."""
    try:
        from sgl_kernel_sm120 import _ext

        return _ext.unavailable_reason()
    except Exception as exc:
        return f"cannot load sgl_kernel_sm120 ({type(exc).__name__}: {exc})"


def p2p_row(device_index: int) -> dict[str, bool]:
    """Which locally visible GPUs (by UUID) this GPU can access as a CUDA peer."""
    import torch

    row: dict[str, bool] = {}
    for other in range(torch.cuda.device_count()):
        uuid = gpu_uuid(torch.cuda.get_device_properties(other))
        try:
            row[uuid] = other == device_index or bool(torch.cuda.can_device_access_peer(device_index, other))
        except Exception as exc:
            logger.warning("can_device_access_peer(%d, %d) failed: %s", device_index, other, exc)
            row[uuid] = False
    return row


def local_facts(device, mode: str) -> dict[str, Any]:
    """This rank's facts. P2P, the kernels and the key are looked at only where the gate can use them (mode on, or
    an SM120 GPU): elsewhere auto mode leaves the process as it was."""
    facts: dict[str, Any] = {"mode": mode, "node": node_identity(), "capability": None, "uuid": None,
                             "name": None, "p2p": None, "kernel_error": None, "key": None}
    try:
        import torch

        if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(_index(device))
            facts.update(capability=[props.major, props.minor], uuid=gpu_uuid(props), name=str(props.name))
            if mode == "on" or tuple(facts["capability"]) == SM120:
                facts.update(p2p=p2p_row(_index(device)), kernel_error=kernel_error(), key=key_facts(device))
    except Exception as exc:
        facts["probe_error"] = f"{type(exc).__name__}: {exc}"
        logger.warning("sglang_sm120: probing the local GPU failed: %s", facts["probe_error"])
    return facts


def driver_version() -> str:
    """The NVIDIA kernel driver's version ('580.95.05'), or 'unknown'."""
    try:
        with open("/proc/driver/nvidia/version") as handle:
            found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", handle.read())
        return found.group(1) if found else "unknown"
    except OSError:
        return "unknown"


def library_identity() -> str:
    """The kernel library this process loads: file name, size and modification time (a rebuild changes it)."""
    try:
        from sgl_kernel_sm120 import _ext

        path = _ext.library_path()
        stat = os.stat(path)
        return f"{os.path.basename(path)}:{stat.st_size}:{int(stat.st_mtime)}"
    except Exception as exc:
        return f"unavailable ({type(exc).__name__})"


def key_facts(device) -> dict[str, Any]:
    """This rank's part of the routing-table key (routing/table.make_key): its GPU and what can change a
    measurement. The server and the tune both call it, so both compute the same key."""
    import torch

    from .version import __version__

    props = torch.cuda.get_device_properties(_index(device))
    bus = (f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0" if all(
        hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")) else None)
    try:
        version = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        version = "unknown"
    # A table measured against one NCCL configuration says nothing about another; NCCL_DEBUG* changes where NCCL
    # logs, not how it moves data.
    settings = {k: v for k, v in nccl.settings().items() if not k.startswith("NCCL_DEBUG")}
    return {"uuid": gpu_uuid(props), "pci_bus_id": bus, "name": str(props.name), "driver": driver_version(),
            "cuda": str(torch.version.cuda), "torch": str(torch.__version__), "nccl": version,
            "nccl_settings": settings, "sglang_sm120": __version__, "kernels": library_identity()}


def launch_facts(workspace) -> dict[str, Any]:
    """How a built workspace launches (part of the key): the cluster sizes and SM budget its ranks agreed, PDL, and
    the kernel switches that change them. A route measured under other launch facts runs another launch."""
    from sgl_kernel_sm120.settings import launch_switches, read

    return {"clusters": sorted(int(c) for c in workspace.fused_clusters.get("clusters") or []),
            "sm_budget": int(workspace.sm_budget), "pdl": bool(workspace.use_pdl),
            "switches": launch_switches(read())}


@dataclass(frozen=True)
class GroupFacts:
    modes: list[str]
    capabilities: list[tuple[int, int] | None]
    nnodes: int
    p2p: list[list[bool]] | None
    kernel_errors: list[str | None]
    uuids: list[str | None]
    names: list[str | None]
    keys: list[dict | None]


def group_facts(all_facts: list[dict[str, Any]]) -> GroupFacts:
    """Every rank's facts (rank order) as the gate's inputs."""
    def every(name):
        return [f.get(name) for f in all_facts]

    uuids, p2p = every("uuid"), None
    if all(f.get("p2p") is not None for f in all_facts) and all(uuids):
        # rank i reaches rank j iff i's GPU lists j's (by UUID); a GPU i cannot see counts as unreachable
        p2p = [[i == j or bool(f["p2p"].get(uuids[j], False)) for j in range(len(all_facts))]
               for i, f in enumerate(all_facts)]
    return GroupFacts(modes=every("mode"), capabilities=[tuple(c) if c else None for c in every("capability")],
                      nnodes=len(set(every("node"))), p2p=p2p, kernel_errors=every("kernel_error"), uuids=uuids,
                      names=every("name"), keys=every("key"))
