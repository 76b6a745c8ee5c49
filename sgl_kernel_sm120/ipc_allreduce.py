"""`IpcAllReduce`: the workspace of one group and the two ops that run a route on it.

    ar = IpcAllReduce(gloo_group_or_exchange, device, max_numel=64 * 7168)
    out = ar.all_reduce(x)                                       # x is not written; the seed route of its size
    norm, res = ar.all_reduce_add_rmsnorm(x, residual, w, 1e-6)  # fresh outputs unless given
    ar.close()

Construction is collective: one round for the arguments (their agreement, the NVLink vote, the tmpfs check), then
construction.build's, then one for the data-path probe. The checked ops check a call once (`refusal`, which
explains); `launch` and `launch_fused` run a route the caller checked and resolved (policy.resolve), checking
nothing: the C++ ops check what memory safety needs, and keep a rank's calls in one order whatever stream they come
from (csrc/ar_protocol.cuh I6). Every rank makes the same calls, which `supports()`, `refusal()` and the seeds, pure
in group-identical inputs, keep so.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import _ext, construction, data_path_probe, policy
from . import settings as switches
from .errors import IpcAllReduceError, IpcAllReduceTimeoutError
from .exchange import agree, attempt, exchange_of
from .policy import Link, Memory, Route, Transport, WorkspaceShape
from .watchdog import ON_TIMEOUT_MODES, ErrorRecord, SlowRecord, Watchdog

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in policy.DTYPES)
CLOSE_BARRIER_TIMEOUT_S = 60.0
AUTO = "auto"


class IpcAllReduce:
    def __init__(self, group, device, max_numel: int, dtype: torch.dtype = torch.bfloat16, *, islands=None,
                 link: str = AUTO, memory: str = "device", timeout_s: float | None = None,
                 warn_after_s: float | None = None, on_timeout: str = "trap", transport: str = AUTO,
                 settings: switches.KernelSettings | None = None):
        """group: a torch.distributed CPU (gloo) group or an exchange; every argument the same on every rank.
        memory "host": every rank's scratch in one shared file on a tmpfs (settings.shm_dir), pinned and mapped into
        every GPU: no P2P needed, no islands. link "auto": NVLink if NVML finds it on every rank. timeout_s and
        warn_after_s bound the waits (I7, I9; default: the settings'). on_timeout (I7): "trap" ends the CUDA context
        of a rank whose wait timed out; "exit" poisons the workspace and keeps the context (tests, measurements).
        transport: the seed routes' ("auto": push). settings default: settings.read(), inside the first round, so a
        bad switch on one rank fails every rank."""
        self.exchange = exchange_of(group)
        self.rank, self.world_size = self.exchange.rank, self.exchange.world_size

        def check() -> dict:
            self._set_fields(device, max_numel, dtype, islands, link, memory, timeout_s, warn_after_s, on_timeout,
                             transport, switches.read() if settings is None else settings)
            host = self.memory is Memory.HOST
            signature = [self.world_size, self.max_numel, str(dtype), self.islands, link, self.memory.value,
                         self.timeout_s, self.warn_after_s, on_timeout, self.shm_dir if host else "", transport]
            nvlink = not host and (link == "nvlink" or (link == AUTO and _has_nvlink(self.device)))
            name = construction.host_file_name(_ext.ops(), self._config(), self.settings) if host else ""
            return {"signature": signature, "nvlink": nvlink, "name": name}

        every_rank = agree(self.exchange, "argument check", *attempt(check))
        signatures = [entry["signature"] for entry in every_rank]
        if any(signature != signatures[0] for signature in signatures):
            raise IpcAllReduceError(f"IpcAllReduce arguments differ across ranks: {signatures}")
        self.link = Link.HOST if self.memory is Memory.HOST else (
            Link.NVLINK if all(entry["nvlink"] for entry in every_rank) else Link.PCIE)
        ops = _ext.ops()
        self._handle, agreed = construction.build(ops, self.exchange, self._config(), self.settings,
                                                  every_rank[0]["name"])
        try:
            if self.world_size > 1:
                data_path_probe.run(ops, self._handle, self.exchange, self.memory.value, self.timeout_s,
                                    self.settings.debug_probe_drop)
        except Exception:
            self._release()
            raise
        self._start(ops, agreed)

    def _set_fields(self, device, max_numel, dtype, islands, link, memory, timeout_s, warn_after_s, on_timeout,
                    transport, settings: switches.KernelSettings) -> None:
        """This rank's fields from the constructor's arguments, nothing built yet; ValueError on a bad one."""
        self._handle, self._watchdog, self._shape = 0, None, None
        self.settings = settings
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {self.device}")
        self.max_numel, self.dtype, self.on_timeout = int(max_numel), dtype, on_timeout
        self.timeout_s = float(settings.timeout_s if timeout_s is None else timeout_s)
        self.warn_after_s = float(settings.warn_after_s if warn_after_s is None else warn_after_s)
        self.abort_after_s, self.use_pdl, self.shm_dir = settings.abort_after_s, settings.pdl, settings.shm_dir
        self.limits = limits = policy.kernel_limits()  # the library loads, and was built from these sources
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(policy.DTYPES)}, got {dtype}")
        if self.world_size not in policy.WORLD_SIZES:
            raise ValueError(f"world size must be one of {policy.WORLD_SIZES}, got {self.world_size}")
        if self.max_numel <= 0 or self.max_numel % limits.elems_per_pack:
            raise ValueError(f"max_numel must be a positive multiple of {limits.elems_per_pack}, got {max_numel}")
        if not (0 < self.timeout_s < 1e9 and 0 < self.warn_after_s < 1e9):  # also refuses nan
            raise ValueError(f"timeout_s and warn_after_s must be > 0 seconds, got {self.timeout_s}, "
                             f"{self.warn_after_s}")
        if link not in (AUTO, Link.NVLINK.value, Link.PCIE.value):
            raise ValueError(f"link must be 'auto', 'nvlink' or 'pcie', got {link!r}")
        if memory not in tuple(Memory):
            raise ValueError(f"memory must be 'device' or 'host', got {memory!r}")
        if on_timeout not in ON_TIMEOUT_MODES:
            raise ValueError(f"on_timeout must be 'trap' or 'exit', got {on_timeout!r}")
        self.memory = Memory(memory)
        self.transport = policy.SEED_TRANSPORT if transport == AUTO else _transport(transport)
        self.oneshot_max_numel = policy.oneshot_max_numel(self.world_size, self.memory, self.max_numel, limits)
        self.islands = construction.validate_islands(islands, self.world_size)
        self.num_islands = len(self.islands) if self.islands else 1
        if self.memory is Memory.HOST and self.islands:
            raise ValueError("islands need memory='device': through host memory every pair is one hop")
        if not torch.cuda.is_available():  # kernels_available() only says the library loads
            raise RuntimeError(f"no CUDA driver/GPU: torch.cuda.is_available() is False in this process (no NVIDIA "
                               f"driver, one too old for torch's CUDA {torch.version.cuda}, or no visible GPU; check "
                               "nvidia-smi and CUDA_VISIBLE_DEVICES)")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _config(self) -> construction.Config:
        return construction.Config(self.device.index, self.rank, self.world_size, self.max_numel,
                                   self.oneshot_max_numel, self.timeout_s, self.warn_after_s, self.on_timeout == "trap",
                                   self.islands, self.memory, self.shm_dir)

    def _start(self, ops, agreed: dict) -> None:
        self.sm_budget = int(agreed["sm_budget"])
        self.fused_clusters = {"clusters": list(agreed["clusters"]), "reason": agreed["reason"]}
        self._shape = WorkspaceShape(self.world_size, self.memory, self.link, self.num_islands,
                                     self.oneshot_max_numel * policy.ELEMENT_BYTES, tuple(agreed["clusters"]),
                                     self.sm_budget)
        self._watchdog = Watchdog(
            self.rank, ErrorRecord.from_address(int(ops.ws_error_record_address(self._handle))),
            SlowRecord.from_address(int(ops.ws_slow_record_address(self._handle))), timeout_s=self.timeout_s,
            on_timeout=self.on_timeout, abort_after_s=self.abort_after_s, context_alive=self._context_alive)
        self._watchdog.start()
        logger.info("IpcAllReduce rank %d/%d on %s: memory=%s link=%s islands=%s max_numel=%d timeout=%.1fs (%s) "
                    "warn=%.1fs; launch: %d SMs (group minimum), fused rows %s", self.rank, self.world_size,
                    self.device, self.memory.value, self.link.value, self.islands, self.max_numel, self.timeout_s,
                    self.on_timeout, self.warn_after_s, self.sm_budget, self.describe_fused_launch())

    def _context_alive(self) -> bool:
        """For the watchdog: False once closed; raises once a trap has ended the CUDA context."""
        if self._handle == 0:
            return False
        _ext.ops().ws_check_context(self._handle)
        return True

    def describe_fused_launch(self) -> str:
        """For logs: how the fused one-shot spreads a few rows (cluster launch, or its one-CTA fallback)."""
        clusters, reason = self.fused_clusters["clusters"], self.fused_clusters["reason"]
        if clusters:
            return f"over {'/'.join(map(str, sorted(clusters, reverse=True)))}-CTA clusters ({reason})"
        return f"one CTA per row, the cluster kernel's bits without clusters (cluster launch not used: {reason})"

    @property
    def shape(self) -> WorkspaceShape:
        """What this workspace runs, agreed by its ranks."""
        if self._shape is None:
            raise IpcAllReduceError("IpcAllReduce is not built")
        return self._shape

    def supports(self, inp: torch.Tensor) -> bool:
        return (inp.device == self.device and inp.dtype in SUPPORTED_DTYPES and inp.is_contiguous()
                and 0 < inp.numel() <= self.max_numel and inp.numel() % self.limits.elems_per_pack == 0)

    def admits_fused(self, rows: int, hidden: int, dtype: torch.dtype) -> bool:
        """The fused op's shape rule without a tensor, for a caller that decides before it has one."""
        return (dtype in SUPPORTED_DTYPES and 0 < rows * hidden <= self.max_numel
                and hidden % self.limits.elems_per_pack == 0 and hidden <= self.limits.max_fused_hidden)

    def supports_add_rmsnorm(self, inp: torch.Tensor, residual: torch.Tensor | None = None,
                             weight: torch.Tensor | None = None) -> bool:
        """supports(inp) and admits_fused of its shape; a residual like `inp`, a weight [hidden] of its kind."""
        def like_inp(t: torch.Tensor | None, shape: tuple) -> bool:
            return t is None or (tuple(t.shape) == shape and t.dtype == inp.dtype and t.device == inp.device)

        return (inp.dim() == 2 and self.supports(inp) and self.admits_fused(*inp.shape, inp.dtype)
                and like_inp(residual, tuple(inp.shape)) and like_inp(weight, (inp.shape[-1],)))

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None, *, route: Route | None = None,
                   schedule=None, transport=None, ctas: int | None = None, threads: int | None = None,
                   window: int | None = None) -> torch.Tensor:
        """Out-of-place sum over the group; `inp` is never written. `route`: the launch (default: the seed route of
        this size); `schedule`, `transport`, `ctas` (the CTA cap), `threads` and `window` replace those fields."""
        route = self._route(inp, route, schedule=schedule, transport=transport, ctas=ctas, threads=threads,
                            window=window)
        why = self.refusal(inp, route, fused=False, outs=(out,))
        if why:
            raise ValueError(f"IpcAllReduce cannot run this call: {why}")
        return self.launch(policy.resolve(route, inp.nbytes, self.shape, self.limits, False), inp, out)

    def all_reduce_add_rmsnorm(self, inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               norm_out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None, *,
                               route: Route | None = None, schedule=None, transport=None, ctas: int | None = None,
                               cluster: int | None = None,
                               window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual_out = all_reduce(inp) + residual; norm_out = rmsnorm(residual_out) * weight; inputs never written,
        outputs fresh unless given. Two-shot and island: each slice's owner adds its own `residual` (tensor
        parallelism replicates it). `cluster`: the fused one-shot's CTAs per row; the rest as for all_reduce."""
        route = self._route(inp, route, schedule=schedule, transport=transport, ctas=ctas, cluster=cluster,
                            window=window)
        why = self.refusal(inp, route, fused=True, residual=residual, weight=weight, outs=(norm_out, residual_out))
        if why:
            raise ValueError(f"IpcAllReduce cannot run this call: {why}")
        route = policy.resolve(route, inp.nbytes, self.shape, self.limits, True)
        if norm_out is None and residual_out is None:
            return self.launch_fused(route, inp, residual, weight, eps)
        return self.launch_fused_into(route, inp, residual, weight, eps, norm_out, residual_out)

    def _route(self, inp: torch.Tensor, route: Route | None, **fields) -> Route:
        """`route`, else the seed route of this size; each given field replaces the route's."""
        given = {name: value for name, value in fields.items() if value is not None}
        if "transport" in given:
            given["transport"] = self.transport if given["transport"] == AUTO else _transport(given["transport"])
        if route is None:
            route = policy.seed_route(inp.nbytes, self.shape, given.pop("transport", self.transport))
        return dataclasses.replace(route, **given) if given else route

    def refusal(self, inp: torch.Tensor, route: Route, *, fused: bool, residual: torch.Tensor | None = None,
                weight: torch.Tensor | None = None, outs=()) -> str | None:
        """The one Python check of a call: why this workspace cannot run `route` on these tensors, or None. Raises
        nothing but the workspace's own timeout (a timed-out workspace runs nothing)."""
        if (err := self.timeout_error()) is not None:
            raise err
        if self._handle == 0:
            return "this workspace is closed"
        if not (self.supports_add_rmsnorm(inp, residual, weight) if fused else self.supports(inp)):
            shown = (f"shape={tuple(inp.shape)} dtype={inp.dtype} device={inp.device} contiguous={inp.is_contiguous()} "
                     f"numel={inp.numel()} max_numel={self.max_numel}")
            if not fused:
                return f"this workspace cannot take the tensor ({shown}); check supports() first"
            return (f"the fused op takes [rows, hidden] with hidden a multiple of {self.limits.elems_per_pack} up to "
                    f"{self.limits.max_fused_hidden}, the residual like the input and the weight [hidden], on this "
                    f"workspace's device and dtype ({shown}); check supports_add_rmsnorm() first")
        if any(out is not None and (out.shape != inp.shape or out.dtype != inp.dtype or not out.is_contiguous()
                                    or out.device != inp.device) for out in outs):
            return "every output must be contiguous, with the input's shape, dtype and device"
        return policy.refusal(self.shape, route, inp.nbytes, fused=fused, limits=self.limits)

    # The launches: a fresh tensor of torch's allocators is 16-byte aligned, so only a caller's own tensors are
    # checked; an odd offset is one rank's, not the group's, so it is copied, never declined.
    def launch(self, route: Route, inp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        schedule, threads, ctas, _, transport, window = route.launch_args
        target = torch.empty_like(inp) if out is None or not _aligned(out) else out
        _ext.ops().all_reduce(self._handle, _aligned_copy(inp), target, schedule, threads, ctas, self.use_pdl,
                              transport, window)
        if out is not None and target is not out:
            out.copy_(target)
            return out
        return target

    def launch_fused(self, route: Route, inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh (norm, summed): every eager layer boundary's call, so one predicate when the inputs are aligned."""
        schedule, _, ctas, cluster, transport, window = route.launch_args
        residual, weight = residual.contiguous(), weight.contiguous()
        if (inp.data_ptr() | residual.data_ptr() | weight.data_ptr()) % 16:
            inp, residual, weight = _aligned_copy(inp), _aligned_copy(residual), _aligned_copy(weight)
        norm, summed = torch.empty_like(inp), torch.empty_like(inp)
        _ext.ops().all_reduce_add_rmsnorm(self._handle, inp, residual, weight, float(eps), norm, summed, schedule,
                                          ctas, self.use_pdl, cluster, transport, window)
        return norm, summed

    def launch_fused_into(self, route: Route, inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, norm_out: torch.Tensor | None,
                          residual_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """launch_fused into the outputs given (a graph's buffers), through fresh ones where one is unaligned."""
        schedule, _, ctas, cluster, transport, window = route.launch_args
        norm = torch.empty_like(inp) if norm_out is None or not _aligned(norm_out) else norm_out
        summed = torch.empty_like(inp) if residual_out is None or not _aligned(residual_out) else residual_out
        _ext.ops().all_reduce_add_rmsnorm(
            self._handle, _aligned_copy(inp), _aligned_copy(residual.contiguous()), _aligned_copy(weight.contiguous()),
            float(eps), norm, summed, schedule, ctas, self.use_pdl, cluster, transport, window)
        for given, target in ((norm_out, norm), (residual_out, summed)):
            if given is not None and target is not given:
                given.copy_(target)
        return (norm if norm_out is None else norm_out), (summed if residual_out is None else residual_out)

    def close(self, *, collective: bool = True, barrier_timeout_s: float = CLOSE_BARRIER_TIMEOUT_S) -> None:
        """Free the workspace; idempotent. Collective by default: unmap the peers' slabs, wait until every rank has
        unmapped ours (freeing what another process maps is undefined in CUDA), then free ours. collective=False,
        or after a kernel timeout (the context may be gone, the peers dead): the same without the barrier."""
        if self.exchange is None and self._handle:
            raise IpcAllReduceError("a workspace of a local group closes with its group (close_local_group)")
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._handle == 0:
            return
        context_dead = self.timeout_error() is not None
        local_only = not collective or context_dead or self.world_size == 1
        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # a trapped kernel: the context is gone, free what can be freed
            logger.warning("IpcAllReduce rank %d: synchronize before close failed (%s); closing locally", self.rank,
                           exc)
            local_only = context_dead = True
        try:
            _ext.ops().ws_close_peers(self._handle)
        except Exception as exc:
            logger.warning("IpcAllReduce rank %d: unmapping the peers' slabs failed: %s", self.rank, exc)
        if not local_only:
            try:
                self.exchange.barrier(barrier_timeout_s)
            except Exception as exc:
                logger.warning("IpcAllReduce rank %d: not every rank confirmed within %.0f s that it unmapped this "
                               "rank's slab (%s); freeing it anyway", self.rank, barrier_timeout_s, exc)
        try:
            self._release()
        except Exception as exc:
            if not context_dead:
                raise
            logger.warning("IpcAllReduce rank %d: freeing the workspace after a kernel trap failed (%s); its memory is "
                           "released when the process ends", self.rank, exc)

    def timeout_error(self) -> IpcAllReduceTimeoutError | None:
        """The timeout a kernel recorded, if any (a CPU read: works after the trap)."""
        return self._watchdog.timeout_error() if self._watchdog is not None else None

    def calls_completed(self) -> int:
        """Calls completed, counted on the device (graph replays included) and mirrored into host-mapped memory: a
        plain load, safe from a monitoring thread while the serving stream runs; may lag calls in flight."""
        if self._handle == 0:
            raise IpcAllReduceError("IpcAllReduce is closed")
        return int(_ext.ops().ws_calls_completed(self._handle))

    def _release(self) -> None:
        if self._watchdog is not None:
            self._watchdog.forget_records()  # both records live in the pinned block ws_destroy frees
        if self._handle:
            handle, self._handle = self._handle, 0
            _ext.ops().ws_destroy(handle)


def _transport(value) -> Transport:
    try:
        return Transport(getattr(value, "value", value))
    except ValueError:
        raise ValueError(f"transport must be 'push', 'staged', 'pull' or 'auto', got {value!r}") from None


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    return t if _aligned(t) else t.clone()


def _has_nvlink(device: torch.device) -> bool:
    """Whether NVML sees an active NVLink on this GPU. A hint for the seed schedules only: a wrong answer costs
    speed, never correctness, so any failure answers no (PCIe, the label that claims less)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                        return True
                except pynvml.NVMLError:
                    break
            return False
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no pynvml or NVML, an old driver, an unknown UUID format: claim less
        logger.debug("NVLink probe failed (%s); assuming PCIe", exc)
        return False
