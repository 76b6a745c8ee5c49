"""Gathering the facts the gate decides on: what this rank can see, as a JSON-serialisable dict.

Local facts of one rank: its GPU's compute capability and UUID, a node identity, which visible GPUs its GPU
can access as a CUDA peer, and whether sgl_kernel_sm120's kernels load. `group_facts` turns the list of every
rank's local facts into the inputs of `gate.decide`.

P2P is probed here and not taken from SGLang: SGLang runs its P2P test only after deciding that more than
two PCIe-only GPUs cannot use its custom all-reduce, i.e. never on the machines this overlay is for.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def node_identity() -> str:
    """Same string for every process of one machine (containers included), different across machines."""
    boot_id = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot_id = handle.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot_id}"


def gpu_uuid(props) -> str:
    uuid = str(getattr(props, "uuid", ""))
    return uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"


def kernel_error() -> str | None:
    """None when sgl_kernel_sm120 imports and its compiled kernels load, else the reason."""
    try:
        import sgl_kernel_sm120
    except Exception as exc:
        return f"cannot import sgl_kernel_sm120 ({type(exc).__name__}: {exc})"
    try:
        if sgl_kernel_sm120.kernels_available():
            return None
        from sgl_kernel_sm120._ext import unavailable_reason

        return unavailable_reason() or "compiled kernels not available"
    except Exception as exc:
        return f"checking sgl_kernel_sm120's kernels raised {type(exc).__name__}: {exc}"


def p2p_row(device_index: int) -> dict[str, bool]:
    """Which locally visible GPUs (by UUID) the given GPU can access as a CUDA peer."""
    import torch

    row: dict[str, bool] = {}
    for other in range(torch.cuda.device_count()):
        uuid = gpu_uuid(torch.cuda.get_device_properties(other))
        if other == device_index:
            row[uuid] = True
            continue
        try:
            row[uuid] = bool(torch.cuda.can_device_access_peer(device_index, other))
        except Exception as exc:
            logger.warning("can_device_access_peer(%d, %d) failed: %s", device_index, other, exc)
            row[uuid] = False
    return row


def local_facts(device, mode: str) -> dict[str, Any]:
    """This rank's facts. P2P and the kernels are probed only when the decision can use them (mode "on",
    or an SM120 GPU): in auto mode on any other GPU the overlay leaves the process exactly as it was."""
    facts: dict[str, Any] = {
        "mode": mode,
        "node": node_identity(),
        "capability": None,
        "uuid": None,
        "name": None,
        "p2p": None,
        "kernel_error": None,
    }
    try:
        import torch

        if device is not None and getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
            index = device.index if device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            facts["capability"] = [int(props.major), int(props.minor)]
            facts["uuid"] = gpu_uuid(props)
            facts["name"] = str(props.name)
            if mode == "on" or facts["capability"] == [12, 0]:
                facts["p2p"] = p2p_row(index)
                facts["kernel_error"] = kernel_error()
    except Exception as exc:
        facts["probe_error"] = f"{type(exc).__name__}: {exc}"
        logger.warning("sglang_sm120: probing the local GPU failed: %s", facts["probe_error"])
    return facts


def driver_version() -> str:
    """The NVIDIA kernel driver's version ('580.95.05'), or 'unknown'."""
    try:
        with open("/proc/driver/nvidia/version") as handle:
            found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", handle.read())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return "unknown"


def library_identity() -> str:
    """Which kernel library this process loads: its file name, size and modification time (a rebuild changes
    it), or why none loads."""
    try:
        from sgl_kernel_sm120 import _ext

        path = _ext.library_path()
        st = os.stat(path)
        return f"{os.path.basename(path)}:{st.st_size}:{int(st.st_mtime)}"
    except Exception as exc:
        return f"unavailable ({type(exc).__name__})"


def key_facts(device) -> dict[str, Any]:
    """This rank's part of the routing-table key (routing/table.py LOCAL_FIELDS): its GPU and the versions
    that can change a measurement. Needs torch and the GPU; the same function in the server and in the tuner,
    so both compute the same key."""
    import torch

    from .version import __version__

    index = device.index if getattr(device, "index", None) is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    try:
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        nccl = "unknown"
    return {
        "uuid": gpu_uuid(props),
        "pci_bus_id": bus,
        "name": str(props.name),
        "driver": driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": str(torch.__version__),
        "nccl": nccl,
        "sglang_sm120": __version__,
        "kernels": library_identity(),
    }


def launch_facts(workspace, environ=None) -> dict[str, Any]:
    """How a built workspace launches the kernels, for the routing-table key (routing/table.py "launch"): the
    cluster sizes its ranks agreed (the cluster check's verdict), the SM budget, whether it uses programmatic
    dependent launch, and the switches that change them. A route measured under other launch facts runs
    another launch, so the table is not used."""
    env = os.environ if environ is None else environ
    try:
        from sgl_kernel_sm120.cluster_check import SWITCH_ENV
        from sgl_kernel_sm120.env import setting
        from sgl_kernel_sm120.ipc_allreduce import PDL_ENV

        switches = {name: setting(name, "", env) for name in (SWITCH_ENV, PDL_ENV)}
    except ImportError:  # a stand-in kernel package (the CPU tests): the workspace's own facts only
        switches = {}
    clusters = (getattr(workspace, "fused_clusters", None) or {}).get("clusters") or []
    pdl = getattr(workspace, "use_pdl", None)
    return {
        "clusters": sorted(int(c) for c in clusters),
        "sm_budget": int(getattr(workspace, "sm_budget", 0) or 0),
        "pdl": None if pdl is None else bool(pdl),
        "switches": switches,
    }


@dataclass(frozen=True)
class GroupFacts:
    modes: list[str]
    capabilities: list[tuple[int, int] | None]
    nnodes: int
    p2p: list[list[bool]] | None
    kernel_errors: list[str | None]
    uuids: list[str | None]
    names: list[str | None]


def group_facts(all_facts: list[dict[str, Any]]) -> GroupFacts:
    """Combine every rank's local facts (in rank order) into the gate's inputs."""
    capabilities = [tuple(f["capability"]) if f.get("capability") else None for f in all_facts]
    uuids = [f.get("uuid") for f in all_facts]
    p2p: list[list[bool]] | None = None
    if all(f.get("p2p") is not None for f in all_facts) and all(uuids):
        # rank i reaches rank j iff i's GPU lists j's GPU (by UUID) as accessible. A GPU i cannot see at all
        # (different CUDA_VISIBLE_DEVICES) counts as unreachable.
        p2p = [[bool(f["p2p"].get(uuids[j], False)) if i != j else True for j in range(len(all_facts))]
               for i, f in enumerate(all_facts)]
    return GroupFacts(
        modes=[f.get("mode") for f in all_facts],
        capabilities=capabilities,
        nnodes=len({f.get("node") for f in all_facts}),
        p2p=p2p,
        kernel_errors=[f.get("kernel_error") for f in all_facts],
        uuids=uuids,
        names=[f.get("name") for f in all_facts],
    )
