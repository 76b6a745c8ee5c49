"""torch's symmetric-memory one-shot all-reduce."""

from __future__ import annotations

import contextlib
import importlib
import warnings

import torch

from benchmarks.harness.io import short_exc
from benchmarks.harness.ranks import Dist

from .base import Impl, Skip


class TorchSymmMem(Impl):
    """torch.distributed._symmetric_memory one-shot all-reduce. The input is an ordinary tensor; the op copies
    it into the symmetric buffer (one_shot_all_reduce_copy_out) or we copy, then reduce (older torch)."""

    name = "torch_symm_mem"

    def setup(self, d: Dist, max_numel: int) -> None:
        def local():
            symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
            ops = torch.ops.symm_mem
            copy_out = None
            with contextlib.suppress(Exception):
                copy_out = ops.one_shot_all_reduce_copy_out
            plain_out = ops.one_shot_all_reduce_out
            gname = d.nccl.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    symm_mem.enable_symm_mem_for_group(gname)
            buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=d.device)
            return symm_mem, copy_out, plain_out, gname, buf

        ok, val, why = d.attempt(local, "torch symmetric memory")
        if not ok:
            raise Skip(why)
        symm_mem, self.copy_out, self.plain_out, self.gname, self.buf = val
        err = None
        try:
            self.handle = symm_mem.rendezvous(self.buf, self.gname)
        except Exception as e:  # noqa: BLE001
            err = "rendezvous: " + short_exc(e)
        ok, why = d.agree(err is None, err)
        if not ok:
            raise Skip(why)
        self.max_numel = max_numel

    def supports(self, inp, fused=False):
        return inp.numel() <= self.max_numel and (inp.numel() * inp.element_size()) % 16 == 0

    def all_reduce(self, inp, out=None, variant=None):
        sb = self.buf[: inp.numel()].view(inp.shape)
        out = torch.empty_like(inp) if out is None else out
        if self.copy_out is not None:
            self.copy_out(sb, inp, "sum", self.gname, out)
        else:
            sb.copy_(inp)
            self.plain_out(sb, "sum", self.gname, out)
        return out

    def notes(self) -> dict:
        op = "one_shot_all_reduce_copy_out" if self.copy_out is not None else "copy + one_shot_all_reduce_out"
        return {"api": f"torch.ops.symm_mem.{op}"}
