"""Ours: sgl_kernel_sm120.IpcAllReduce, through CUDA IPC over P2P (`sm120`) and through host memory
(`sm120_hostmem`), each on a dedicated gloo group, with every schedule the kernels can be forced to (what the
peers call their variants)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness.io import short_exc
from benchmarks.harness.ranks import Dist

from .base import Impl, Skip

RETRY_NUMEL = 4 << 20  # elements (8 MB of bf16)


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
        for s in self.mod.Schedule:
            out.append((s.name, s))
        return out

    def dispatch_variant(self, nbytes: int) -> str | None:
        try:
            return self.mod.seed_route(nbytes, self.ar.shape).schedule.name
        except Exception:  # noqa: BLE001
            return None

    def supports(self, inp, fused=False):
        if fused and hasattr(self.ar, "supports_add_rmsnorm"):
            return bool(self.ar.supports_add_rmsnorm(inp))
        return bool(self.ar.supports(inp))

    def all_reduce(self, inp, out=None, variant=None):
        if variant is None:
            return self.ar.all_reduce(inp, out)
        return self.ar.all_reduce(inp, out, schedule=variant)

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out=None, residual_out=None, variant=None):
        kw = {} if variant is None else {"schedule": variant}
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
    are no islands (flat schedules only), hence no ISLAND schedule."""

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
        for s in self.mod.Schedule:
            if s.name != "ISLAND":
                out.append((s.name, s))
        return out

    def notes(self) -> dict:
        out = super().notes()
        out["api"] = "sgl_kernel_sm120.IpcAllReduce(memory='host')"
        out["memory"] = getattr(self.ar, "memory", None)
        return out


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
