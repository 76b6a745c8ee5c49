"""SGLang's CustomAllReduceV2 (its NVLink default), built on a gloo group the way SGLang builds it."""

from __future__ import annotations

import contextlib
import importlib
import os

import torch
import torch.distributed as dist

from benchmarks.harness.io import short_exc
from benchmarks.harness.ranks import Dist
from benchmarks.workloads.sglang_compat import install_sglang_standins

from .base import Impl, Skip


class SglangCarV2(Impl):
    """SGLang 0.5.13.post1's CustomAllReduceV2 (JIT via tvm-ffi), built on a gloo group like SGLang does."""

    name = "sglang_car_v2"
    accepts_out = False  # returns a fresh tensor (graph-pool allocated inside a capture)
    # Its one-shot push may leave the sum in the input (seen on 2x H200: "input was modified").
    # SGLang never reads the input again, so treat it like NCCL: checked on a copy, timed on zeros.
    inplace = True

    def setup(self, d: Dist, max_numel: int) -> None:
        group = dist.new_group(backend="gloo")
        standin_note = install_sglang_standins()
        # SGLang's own P2P probe needs its parallel_state initialised; trust the driver's answer instead.
        os.environ.setdefault("SGLANG_SKIP_P2P_CHECK", "1")
        world = d.world_size

        def local():
            m = importlib.import_module("sglang.srt.distributed.device_communicators.custom_all_reduce_v2")
            jit = importlib.import_module("sglang.jit_kernel.all_reduce")
            # Build every JIT module now, on every rank, so no rank compiles (or fails) mid-collective.
            jit.get_custom_all_reduce_cls()
            jit._jit_custom_all_reduce_push_module(torch.bfloat16, world)
            jit._jit_custom_all_reduce_pull_module(torch.bfloat16, world)
            return m

        ok, m, why = d.attempt(local, "import/JIT CustomAllReduceV2")
        if not ok:
            extra = f" (sglang stand-ins: {standin_note})" if standin_note else ""
            raise Skip(why + extra)
        car, err = None, None
        try:
            car = m.CustomAllReduceV2(group=group, device=d.device)
            if car.disabled:
                err = "CustomAllReduceV2 disabled itself (can_use_custom_all_reduce_v2 is False: needs full NVLink)"
        except Exception as e:  # noqa: BLE001
            err = "CustomAllReduceV2(): " + short_exc(e)
        ok, why = d.agree(err is None, err)
        if not ok:
            if car is not None:
                with contextlib.suppress(Exception):
                    car.close()
            raise Skip(why)
        self.car = car

    def supports(self, inp, fused=False):
        return bool(self.car.should_custom_ar(inp))

    def all_reduce(self, inp, out=None, variant=None):
        res = self.car.custom_all_reduce(inp)
        if out is not None:
            out.copy_(res)  # not used in timing: out=None there
            return out
        return res

    def dispatch_variant(self, nbytes: int) -> str | None:
        try:
            t = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="meta")
            return self.car._determine_algo(t).name
        except Exception:  # noqa: BLE001
            return None

    def capture_context(self):
        return self.car.capture()

    def notes(self) -> dict:
        return {"api": "sglang CustomAllReduceV2.custom_all_reduce (out of place), capture() around the graph"}

    def close(self):
        with contextlib.suppress(Exception):
            self.car.close()
