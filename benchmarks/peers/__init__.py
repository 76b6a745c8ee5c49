"""All-reduce implementations measured side by side (ours and its peers), behind one small interface
(base.py), one module each; this registry names them and builds one from the command line's arguments."""

from __future__ import annotations

from benchmarks.harness.nccl_mode import NCCL_NO_P2P, nccl_label_error

from .base import Impl, Skip
from .flashinfer_pcie_ipc import FlashinferPcieIpc
from .nccl import Nccl, NcclNoP2p
from .ours import Sm120, Sm120Hostmem, parse_islands, resolve_islands
from .sglang_car_v2 import SglangCarV2
from .torch_symm_mem import TorchSymmMem

# The default set of a plain run, and of a --no-p2p run (NCCL with NCCL_P2P_DISABLE=1 against ours through host
# memory); every name make_impl knows. `nccl` and `nccl_no_p2p` each belong to one mode only (nccl_label_error).
ALL_IMPLS = ("nccl", "sm120", "torch_symm_mem", "sglang_car_v2", "flashinfer_pcie_ipc")
NO_P2P_IMPLS = (NCCL_NO_P2P, "sm120_hostmem")
KNOWN_IMPLS = (*ALL_IMPLS, "sm120_hostmem", NCCL_NO_P2P)


def make_impl(name: str, args) -> Impl:
    why = nccl_label_error([name], bool(getattr(args, "no_p2p", False)))
    if why:
        raise ValueError(why)
    if name == "nccl":
        return Nccl()
    if name == NCCL_NO_P2P:
        return NcclNoP2p()
    if name == "sm120_hostmem":
        return Sm120Hostmem(timeout_s=getattr(args, "ours_timeout_s", None))
    if name == "sm120":
        return Sm120(
            link=getattr(args, "ours_link", "auto"),
            timeout_s=getattr(args, "ours_timeout_s", None),
            islands=getattr(args, "ours_islands", "auto"),
        )
    if name == "torch_symm_mem":
        return TorchSymmMem()
    if name == "sglang_car_v2":
        return SglangCarV2()
    if name == "flashinfer_pcie_ipc":
        return FlashinferPcieIpc(max_bytes=getattr(args, "flashinfer_max_bytes", 8 << 20))
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(KNOWN_IMPLS)}")


__all__ = [
    "ALL_IMPLS", "KNOWN_IMPLS", "NO_P2P_IMPLS", "FlashinferPcieIpc", "Impl", "Nccl", "NcclNoP2p", "SglangCarV2", "Skip",
    "Sm120", "Sm120Hostmem", "TorchSymmMem", "make_impl", "parse_islands", "resolve_islands",
]
