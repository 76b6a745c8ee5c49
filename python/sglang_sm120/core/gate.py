"""The capability gate: a pure function of the facts every rank gathered (facts.py), so every rank reaches the same
decision without another round trip. Free of torch and SGLang."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sgl_kernel_sm120.policy import WORLD_SIZES

from .config import HOSTMEM_CHOICES, HOSTMEM_ENV, MODES

SM120 = (12, 0)  # RTX PRO 6000 Blackwell / RTX 50xx. Not 12.1 (GB10 / DGX Spark: unified memory, no PCIe P2P)
SUPPORTED_WORLD_SIZES = tuple(w for w in WORLD_SIZES if w > 1)  # 1 is the kernels' no-op

Capability = tuple[int, int] | None  # None: the rank has no CUDA device


@dataclass(frozen=True)
class GateDecision:
    enabled: bool
    reason: str
    memory: str = "device"  # when enabled, the workspace's: "device" (CUDA IPC over P2P) or "host" (no P2P needed)


def _fmt_cap(cap: Capability) -> str:
    return "no CUDA device" if cap is None else f"{cap[0]}.{cap[1]}"


def _ranks_by_capability(capabilities: Sequence[Capability]) -> str:
    by_cap: dict[str, list[int]] = {}
    for rank, cap in enumerate(capabilities):
        by_cap.setdefault(_fmt_cap(cap), []).append(rank)
    return ", ".join(f"ranks {ranks}: {cap}" for cap, ranks in sorted(by_cap.items()))


def decide(mode: str, capabilities: Sequence[Capability], world_size: int, nnodes: int,
           p2p: Sequence[Sequence[bool]] | None, deterministic: bool, kernel_errors: Sequence[str | None] | None = None,
           modes: Sequence[str] | None = None, names: Sequence[str | None] | None = None,
           hostmem: str = "auto") -> GateDecision:
    """Should the TP group use the sm120 IPC backend, and with which workspace memory?

    mode: this rank's; modes: every rank's (they must agree). capabilities: (major, minor) per rank. nnodes: the
    nodes the group spans. p2p[i][j]: rank i's GPU can access rank j's (None: unprobed). kernel_errors: per rank, why
    the kernels do not load there (None: they do). names: the GPUs' names, to explain a missing P2P. A pair without
    P2P gives memory "host" (pinned, device-mapped host memory needs no P2P), or no backend with hostmem "off".
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    if hostmem not in HOSTMEM_CHOICES:
        raise ValueError(f"unknown hostmem {hostmem!r}; allowed: {', '.join(HOSTMEM_CHOICES)}")
    if mode == "off":
        return GateDecision(False, "mode off: SGLang's own all-reduce paths are used unchanged")
    if modes is not None and len(set(modes)) > 1:
        return GateDecision(False, f"ranks disagree on the mode ({list(modes)}); set it the same on every rank")
    if world_size <= 1:
        return GateDecision(False, "world size 1: nothing to reduce")
    if len(capabilities) != world_size:
        return GateDecision(False, f"facts from {len(capabilities)} of {world_size} ranks")
    if any(cap is None for cap in capabilities):
        return GateDecision(False, f"not every rank has a CUDA GPU ({_ranks_by_capability(capabilities)})")
    if mode == "auto" and any(tuple(cap) != SM120 for cap in capabilities):
        note = " (12.1 is GB10/DGX Spark, not an RTX PRO 6000; excluded on purpose)" if any(
            tuple(cap) == (12, 1) for cap in capabilities) else ""
        return GateDecision(False, "auto enables only when every GPU is compute capability 12.0; "
                                   f"found {_ranks_by_capability(capabilities)}{note}. Use mode 'on' to force it")
    if mode == "auto" and deterministic:
        return GateDecision(False, "deterministic inference is on; auto leaves all-reduces to SGLang")
    if world_size not in SUPPORTED_WORLD_SIZES:
        return GateDecision(False, f"world size {world_size} is not one of {SUPPORTED_WORLD_SIZES}")
    if nnodes != 1:
        return GateDecision(False, f"the group spans {nnodes} nodes; CUDA IPC and the host-memory workspace work "
                                   "within one node only")
    if p2p is None:
        return GateDecision(False, "P2P access was not probed")
    missing = [(i, j) for i in range(world_size) for j in range(world_size) if i != j and not bool(p2p[i][j])]
    no_p2p = _explain_missing_p2p(missing, names) if missing else ""
    if missing and hostmem == "off":
        return GateDecision(False, f"{no_p2p}; the pinned host-memory workspace, which needs no P2P, is refused "
                                   f"({HOSTMEM_ENV}=off)")
    failing = {rank: err for rank, err in enumerate(kernel_errors or []) if err}
    if failing:
        first_rank, first_err = next(iter(failing.items()))
        return GateDecision(False, f"sgl_kernel_sm120 kernels unavailable on ranks {sorted(failing)} "
                                   f"(rank {first_rank}: {first_err})")
    if mode == "auto":
        why = f"all {world_size} GPUs are compute capability 12.0 on one node"
    else:
        why = f"mode on (forced) on compute capability {', '.join(sorted({_fmt_cap(c) for c in capabilities}))}, " \
              "one node"
    if missing:
        why += (f"; {no_p2p}, so the workspace goes to pinned, device-mapped host memory, which needs no P2P "
                f"({HOSTMEM_ENV}=off refuses it)")
    else:
        why += ", P2P between every pair"
    if mode == "on" and deterministic:
        why += "; deterministic inference is on (the kernel reduces in a fixed order on every rank)"
    return GateDecision(True, why, memory="host" if missing else "device")


def _explain_missing_p2p(missing: Sequence[tuple[int, int]], names: Sequence[str | None] | None) -> str:
    """Which pairs lack P2P, and why where the GPU names tell: GeForce drivers refuse P2P by policy."""
    shown = ", ".join(f"{i}->{j}" for i, j in missing[:12]) + (" ..." if len(missing) > 12 else "")
    text = f"CUDA P2P access is missing between ranks {shown}"
    geforce = sorted({n for n in (names or []) if n and "geforce" in n.lower()})
    if geforce:
        return (f"{text}: {', '.join(geforce)} is a GeForce card, and the NVIDIA driver disables P2P on GeForce cards "
                "by policy (no BIOS or kernel setting changes that); CUDA IPC over P2P works only on "
                "workstation/datacenter cards such as the RTX PRO 6000 Blackwell")
    return f"{text} (check IOMMU/ACS settings; `python -m sglang_sm120.doctor` explains)"
