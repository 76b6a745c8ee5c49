"""All-reduce implementations measured side by side (ours and its peers), behind one small interface.

Every ``setup`` is staged so that ranks never diverge before a collective: local steps (imports, JIT builds)
run on every rank and are *agreed* (``Dist.attempt``) before any collective step (handle exchange) starts.
A failed peer raises ``Skip(reason)`` on every rank at the same point; the benchmark records it and goes on.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness.common import NCCL_NO_P2P, Dist, install_sglang_standins, nccl_label_error, short_exc

RETRY_NUMEL = 4 << 20  # elements (8 MB of bf16)


class Skip(Exception):
    """Raised identically on every rank when an implementation cannot run here."""


class Impl:
    name = "?"
    inplace = False  # all_reduce writes its input (NCCL)
    accepts_out = True  # all_reduce(inp, out) writes into a preallocated out
    native_fused = False  # has its own all-reduce + add + RMSNorm

    def setup(self, d: Dist, max_numel: int) -> None:
        pass

    def variants(self) -> list[tuple[str | None, Any]]:
        """[(label, variant)] to measure; label None means 'whatever the implementation's dispatch picks'."""
        return [(None, None)]

    def dispatch_variant(self, nbytes: int) -> str | None:
        return None

    def supports(self, inp: torch.Tensor, fused: bool = False) -> bool:
        return True

    def prepare_shape(self, shape: tuple[int, ...]) -> None:
        """Collective per-shape preparation before capture (FlashInfer's prepare)."""

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None, variant: Any = None) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out, residual_out, variant=None):
        raise NotImplementedError

    def capture_context(self):
        return contextlib.nullcontext()

    def notes(self) -> dict:
        return {}

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------


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


class Sm120(Impl):
    """Ours: sgl_kernel_sm120.IpcAllReduce over a dedicated gloo group."""

    name = "sm120"
    native_fused = True

    def __init__(self, link: str = "auto", timeout_s: float | None = None, islands: str = "auto") -> None:
        self.link = link
        self.timeout_s = timeout_s
        self.islands_arg = islands
        self.islands = None
        self.ar = None

    def _import(self):
        return importlib.import_module("sgl_kernel_sm120")

    def _ctor_kwargs(self, d: Dist) -> dict:
        """Constructor keywords, identical on every rank (may run collectives: every rank calls it)."""
        self.islands, self.islands_source = resolve_islands(d, self.islands_arg)
        kwargs = {"link": self.link, "islands": self.islands}
        if self.timeout_s:
            kwargs["timeout_s"] = self.timeout_s
        return kwargs

    def _check_built(self) -> str | None:
        """After construction: None, or why this workspace is not the one the name promises."""
        return None

    def setup(self, d: Dist, max_numel: int) -> None:
        group = dist.new_group(backend="gloo")  # collective: every rank creates it, whatever happens next
        ok, mod, why = d.attempt(self._import, "import sgl_kernel_sm120")
        if not ok:
            raise Skip(why)
        self.mod = mod
        kwargs = self._ctor_kwargs(d)
        self.retry_note = None
        # One retry with an 8 MB bound (e.g. the full sweep's 64 MB workspace did not fit): sizes above it are
        # then reported as unsupported instead of losing ours altogether.
        bounds = [max_numel] + ([RETRY_NUMEL] if max_numel > RETRY_NUMEL else [])
        first_error = "IpcAllReduce() failed"
        for numel in bounds:
            err = None
            try:
                self.ar = mod.IpcAllReduce(group, d.device, numel, dtype=torch.bfloat16, **kwargs)
            except Exception as e:  # noqa: BLE001 - the constructor raises on every rank together
                err = f"IpcAllReduce(max_numel={numel}): " + short_exc(e)
            ok, why = d.agree(err is None, err)
            if ok:
                bad = None
                try:
                    bad = self._check_built()
                except Exception as e:  # noqa: BLE001
                    bad = "checking the workspace: " + short_exc(e)
                ok, why = d.agree(bad is None, bad)
                if not ok:
                    with contextlib.suppress(Exception):
                        self.ar.close()  # every rank holds one here: the collective close
                    self.ar = None
                    raise Skip(why)
                if numel != max_numel:
                    self.retry_note = f"built with max_numel={numel} after: {first_error}"
                return
            if self.ar is not None:  # peers may not hold one: no collective close
                with contextlib.suppress(Exception):
                    self.ar.close(collective=False)
            self.ar = None
            if numel == max_numel:
                first_error = why
        raise Skip(first_error)

    def variants(self):
        out: list[tuple[str | None, Any]] = [(None, None)]
        for v in self.mod.Variant:
            out.append((v.name, v))
        return out

    def dispatch_variant(self, nbytes: int) -> str | None:
        try:
            v = self.ar.choose_variant(nbytes)
            return getattr(v, "name", str(v))
        except Exception:  # noqa: BLE001
            return None

    def supports(self, inp, fused=False):
        if fused and hasattr(self.ar, "supports_add_rmsnorm"):
            return bool(self.ar.supports_add_rmsnorm(inp))
        return bool(self.ar.supports(inp))

    def all_reduce(self, inp, out=None, variant=None):
        if variant is None:
            return self.ar.all_reduce(inp, out)
        return self.ar.all_reduce(inp, out, variant=variant)

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out=None, residual_out=None, variant=None):
        kw = {} if variant is None else {"variant": variant}
        return self.ar.all_reduce_add_rmsnorm(inp, residual, weight, eps, norm_out, residual_out, **kw)

    def notes(self) -> dict:
        link = getattr(getattr(self.ar, "link", None), "value", self.link)
        out = {"api": "sgl_kernel_sm120.IpcAllReduce", "link": link, "islands": self.islands,
               "islands_source": self.islands_source}
        if self.retry_note:
            out["note"] = self.retry_note
        return out

    def close(self):
        if self.ar is not None:
            with contextlib.suppress(Exception):
                self.ar.close()
            self.ar = None


class Sm120Hostmem(Sm120):
    """Ours through host memory: IpcAllReduce(memory="host"), the transport for GPUs without CUDA P2P. The
    workspace is pinned, device-mapped shared host memory, so every push and every poll crosses PCIe; there
    are no islands (flat schedules only), hence no ISLAND variant."""

    name = "sm120_hostmem"

    def __init__(self, timeout_s: float | None = None) -> None:
        super().__init__(link="auto", timeout_s=timeout_s, islands="none")

    def _import(self):
        mod = importlib.import_module("sgl_kernel_sm120")
        try:
            params = inspect.signature(mod.IpcAllReduce).parameters
        except (TypeError, ValueError):
            params = {}
        if "memory" not in params:
            raise RuntimeError("this sgl_kernel_sm120's IpcAllReduce has no memory= argument (no host-memory "
                               "transport in this build)")
        return mod

    def _ctor_kwargs(self, d: Dist) -> dict:
        self.islands, self.islands_source = None, "none: the host-memory workspace has no islands"
        kwargs = {"memory": "host", "islands": None}
        if self.timeout_s:
            kwargs["timeout_s"] = self.timeout_s
        return kwargs

    def _check_built(self) -> str | None:
        memory = getattr(self.ar, "memory", None)
        link = getattr(getattr(self.ar, "link", None), "value", getattr(self.ar, "link", None))
        if memory != "host" or link != "host":
            return f"IpcAllReduce(memory='host') built memory={memory!r}, link={link!r}: not the host transport"
        return None

    def variants(self):
        out: list[tuple[str | None, Any]] = [(None, None)]
        for v in self.mod.Variant:
            if v.name != "ISLAND":
                out.append((v.name, v))
        return out

    def notes(self) -> dict:
        out = super().notes()
        out["api"] = "sgl_kernel_sm120.IpcAllReduce(memory='host')"
        out["memory"] = getattr(self.ar, "memory", None)
        return out


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


class SglangCarV2(Impl):
    """SGLang 0.5.13.post1's CustomAllReduceV2 (JIT via tvm-ffi), built on a gloo group like SGLang does."""

    name = "sglang_car_v2"
    accepts_out = False  # returns a fresh tensor (graph-pool allocated inside a capture)
    # Its one-shot push may leave the sum in the input (seen on 2x H200, 2026-11-29: "input was modified").
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


def parse_islands(text: str, world: int) -> list[list[int]] | None:
    """'0,1,2,3/4,5,6,7' -> [[0,1,2,3],[4,5,6,7]]; 'halves' -> two halves; 'none'/'' -> None."""
    t = (text or "").strip().lower()
    if t in ("", "none", "flat"):
        return None
    if t == "halves":
        return [list(range(world // 2)), list(range(world // 2, world))] if world >= 4 else None
    return [[int(x) for x in grp.split(",") if x.strip()] for grp in t.split("/") if grp.strip()]


def resolve_islands(d: Dist, arg: str) -> tuple[list[list[int]] | None, str]:
    """Islands for our workspace, identical on every rank. 'auto': rank 0 probes the PCIe/NUMA topology with
    the overlay's probe (sglang_sm120.topology) and everyone takes its answer; the kernel's island schedule
    is for 8 ranks in two islands of four, so anything else is flat."""
    if (arg or "auto") != "auto":
        return parse_islands(arg, d.world_size), "given"
    uuid = ""
    with contextlib.suppress(Exception):
        props = torch.cuda.get_device_properties(d.device)
        u = str(getattr(props, "uuid", ""))
        uuid = u if u.startswith("GPU-") or not u else f"GPU-{u}"
    uuids = d.all_gather_obj(uuid)
    answer = (None, "auto: flat (world size is not 8)")
    if d.rank == 0 and d.world_size == 8:
        try:
            topo = importlib.import_module("sglang_sm120.core.topology")
            t = topo.probe(uuids)
            isl = topo.kernel_islands(t.islands(), d.world_size)
            answer = (isl, f"auto: probed ({t.error or 'ok'})")
        except Exception as e:  # noqa: BLE001
            answer = (None, f"auto: probe unavailable ({short_exc(e)})")
    return d.all_gather_obj(answer)[0]


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
