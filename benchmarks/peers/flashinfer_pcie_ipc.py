"""FlashInfer's PCIe-IPC all-reduce (PcieIpcAllReduceWorkspace, FlashInfer 0.7.x)."""

from __future__ import annotations

import contextlib
import importlib

import torch

from benchmarks.harness.io import short_exc
from benchmarks.harness.ranks import Dist

from .base import Impl, Skip


class FlashinferPcieIpc(Impl):
    """FlashInfer's PcieIpcAllReduceWorkspace (0.7.x). Sized to the small-message range it is meant for."""

    name = "flashinfer_pcie_ipc"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    def setup(self, d: Dist, max_numel: int) -> None:
        def local():
            comm = importlib.import_module("flashinfer.comm")
            return comm.PcieIpcAllReduceWorkspace

        ok, cls, why = d.attempt(local, "import flashinfer.comm.PcieIpcAllReduceWorkspace")
        if not ok:
            raise Skip(why)
        numel = min(max_numel, self.max_bytes // 2)
        numel -= numel % 8
        ws, err = None, None
        try:
            ws = cls(group=d.nccl, max_numel=numel, dtype=torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - raised jointly on every rank by its constructor
            err = "PcieIpcAllReduceWorkspace(): " + short_exc(e)
        ok, why = d.agree(err is None, err)
        if not ok:
            raise Skip(why)
        self.ws = ws

    @staticmethod
    def _2d(t):
        return t.view(-1, t.shape[-1]) if t.dim() != 2 else t

    def supports(self, inp, fused=False):
        return bool(self.ws.supports(self._2d(inp)))

    def prepare_shape(self, shape):
        rows = 1 if len(shape) == 1 else shape[0]
        self.ws.prepare([(rows, shape[-1])], dtype=torch.bfloat16)

    def all_reduce(self, inp, out=None, variant=None):
        o = None if out is None else self._2d(out)
        res = self.ws.all_reduce(self._2d(inp), out=o)
        return res.view(inp.shape)

    def notes(self) -> dict:
        return {"api": "flashinfer.comm.PcieIpcAllReduceWorkspace.all_reduce (seed/tuned config)"}

    def close(self):
        with contextlib.suppress(Exception):
            self.ws.destroy()
