"""NCCL through torch.distributed (in place, on the default group), with and without its P2P transport."""

from __future__ import annotations

import os

import torch.distributed as dist

from benchmarks.harness.nccl_mode import NCCL_NO_P2P
from benchmarks.harness.ranks import Dist

from .base import Impl, Skip


class Nccl(Impl):
    name = "nccl"
    inplace = True

    def setup(self, d: Dist, max_numel: int) -> None:
        self.group = d.nccl

    def all_reduce(self, inp, out=None, variant=None):
        dist.all_reduce(inp, group=self.group)
        return inp

    def notes(self) -> dict:
        return {"api": "torch.distributed.all_reduce (in place, default NCCL group)"}


class NcclNoP2p(Nccl):
    """NCCL with NCCL_P2P_DISABLE=1: its shared-memory transport (data staged in host memory). Only in a
    --no-p2p run, which sets the variable before NCCL's first communicator (common.prepare_nccl_mode)."""

    name = NCCL_NO_P2P

    def setup(self, d: Dist, max_numel: int) -> None:
        value = os.environ.get("NCCL_P2P_DISABLE")
        ok, why = d.agree(value == "1", f"NCCL_P2P_DISABLE is {value!r} in this process, not '1'")
        if not ok:
            raise Skip(why)
        super().setup(d, max_numel)

    def notes(self) -> dict:
        return {"api": "torch.distributed.all_reduce (in place, default NCCL group) with NCCL_P2P_DISABLE=1 "
                       "(NCCL's shared-memory transport)",
                "NCCL_P2P_DISABLE": os.environ.get("NCCL_P2P_DISABLE")}
