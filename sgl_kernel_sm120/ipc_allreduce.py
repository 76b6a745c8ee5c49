"""`IpcAllReduce`: the workspace of one process group and the two ops that run a route on it.

Construction is collective over a CPU (gloo) process group: construction.py builds the slabs and agrees the launch
limits, data_path_probe.py checks the data path, watchdog.py watches the wait records. Every step records its
outcome on each rank, the outcomes are gathered, and every rank raises together if any rank failed. Arguments are
checked to be identical on every rank.

Use (docs/design.md, "Kernel contract", has the full contract):
    ar = IpcAllReduce(gloo_group, device, max_numel=64 * 7168)
    out = ar.all_reduce(x)                                      # x is not written; the seed route of its size
    out = ar.all_reduce(x, route=Route(Variant.TWOSHOT, "pull", "device", ctas=94))  # a measured launch
    norm, res = ar.all_reduce_add_rmsnorm(x, residual, w, 1e-6) # fresh outputs unless given
    ar.close()

A call runs a `policy.Route` (the whole launch: variant, transport, memory, CTAs, cluster, threads). The checked
ops check their arguments once, in Python (`refusal`), and explain; `launch` / `launch_fused` run a route whose
arguments the caller has checked that way (the overlay checks a call once on its way in). The C++ ops check again
what memory safety needs.

One workspace serves one stream at a time (protocol invariant I6 in csrc/ar_protocol.cuh): the calls of a
rank must be totally ordered. Capturing on a side stream and replaying on another stream is fine.
Every rank must make the same sequence of calls with the same shapes and routes; `supports()`, `refusal()` and
the seed routes are pure functions of group-identical inputs so that this holds by construction.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch
import torch.distributed as dist

from . import _ext, construction, data_path_probe, policy
from .env import setting
from .errors import IpcAllReduceError, IpcAllReduceTimeoutError
from .link import local_gpu_has_nvlink
from .policy import Link, Memory, Route, Transport, Variant, WorkspaceShape
from .watchdog import (
    ABORT_AFTER_ENV,
    DEFAULT_ABORT_AFTER_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WARN_S,
    ON_TIMEOUT_MODES,
    TIMEOUT_ENV,
    WARN_ENV,
    Watchdog,
    seconds_from_env,
)

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in policy.DTYPES)
CLOSE_BARRIER_TIMEOUT_S = 60.0
PDL_ENV = "SGL_SM120_AR_PDL"  # "0" launches without programmatic dependent launch
AUTO = "auto"


class IpcAllReduce:
    def __init__(
        self,
        group,
        device,
        max_numel: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        islands=None,
        link: str = "auto",
        memory: str = "device",
        timeout_s: float | None = None,
        warn_after_s: float | None = None,
        on_timeout: str = "trap",
        transport: str = AUTO,
    ):
        """memory="device": each rank's scratch in its GPU, reached by peers over CUDA IPC/P2P (NVLink or PCIe).
        memory="host": no P2P needed (GeForce cards): the scratch of every rank in one shared file on a tmpfs
        (SGL_SM120_SHM_DIR, default /dev/shm), pinned and mapped into every GPU; all ranks on one host; no islands.
        Same ops, same results.
        on_timeout (csrc/ar_protocol.cuh I7): "trap" (default) ends the CUDA context of a rank whose wait timed
        out, so no wrong result flows on; "exit" records the timeout, poisons the workspace (every later call
        does nothing and raises) and keeps the context usable: for tests and measurements, where the caller
        checks synchronize().
        transport: the transport of this workspace's seed routes, "push", "staged" or "pull" (csrc/transports/),
        or "auto": policy.SEED_TRANSPORT. A route names its own. Results are bit for bit the same whichever
        transport runs."""
        self.group = group
        self._set_fields(dist.get_rank(group), dist.get_world_size(group), device, max_numel, dtype, memory,
                         timeout_s, warn_after_s, on_timeout, transport)

        # Step 1: arguments, checked locally, then compared across ranks.
        error = None
        groups = None
        try:
            groups = self._check_arguments(max_numel, dtype, islands, link, memory, on_timeout, transport)
            data_path_probe.drop_target(self.rank)  # a malformed debug switch fails here, on every rank
        except Exception as exc:  # every rank must learn about it: see construction.joint_check
            error = f"{type(exc).__name__}: {exc}"
        construction.joint_check(group, error, "argument check")
        signature = (
            self.world_size, self.max_numel, str(dtype), groups, link, memory, self.timeout_s, self.warn_after_s,
            on_timeout, self.shm_dir if memory == "host" else "", transport,
        )
        signatures: list = [None] * self.world_size
        dist.all_gather_object(signatures, signature, group=group)
        if any(s != signature for s in signatures):
            raise IpcAllReduceError(f"IpcAllReduce arguments differ across ranks: {signatures}")
        self.islands = groups
        self.num_islands = len(groups) if groups else 1

        # Step 2: link type (agreed: NVLink only if every rank sees it).
        if memory == "host":
            self.link = Link.HOST
        else:
            local_nvlink = link == "nvlink" or (link == "auto" and local_gpu_has_nvlink(self.device))
            votes: list = [None] * self.world_size
            dist.all_gather_object(votes, local_nvlink, group=group)
            self.link = Link.NVLINK if all(votes) else Link.PCIE

        # Step 3: the slabs, the launch limits every rank uses, the data-path probe.
        ops = _ext.ops()
        config = self._config(groups)
        build = construction.create_host if memory == "host" else construction.create_device
        self._handle = build(ops, group, config)
        try:
            self._set_launch_limits(construction.install_launch_limits(ops, self._handle, group, self.world_size,
                                                                    self.device))
            if self.world_size > 1:
                self.probe_rounds, self.probe_read_rounds = data_path_probe.run(
                    ops, self._handle, group, self.rank, self.world_size, memory, self.timeout_s)
        except Exception:
            self._release()
            raise
        self._start(ops)

    @classmethod
    def local_group(
        cls,
        device,
        world_size: int,
        max_numel: int,
        dtype: torch.dtype = torch.bfloat16,
        *,
        islands=None,
        link: str = "pcie",
        timeout_s: float = 30.0,
        warn_after_s: float | None = None,
        on_timeout: str = "exit",
        transport: str = AUTO,
    ) -> list[IpcAllReduce]:
        """Tests and benchmarks: the whole group in THIS process, one workspace per rank on one GPU, each seeing
        the others' slabs directly (no IPC, no process group). Launched together, on W streams or as W parallel
        branches of one CUDA graph, the ranks' kernels run concurrently, which ranks in separate processes sharing
        a GPU never do (they time-slice): a race in a protocol can show here. Co-residency: each rank gets
        SMs // W of the SMs (and a W-th of the cluster capacity), so the W ranks' CTAs fit the GPU at once; the
        mode refuses a world the GPU cannot hold so. The results are the same bits as in separate processes.
        Close the group with close_local_group(); a workspace of it alone is not closable.

        Eager calls must be issued call-major: every rank's call k before any rank's call k + 1. With CUDA's lazy
        module loading (the default), the first launch of a kernel may wait for the whole context: issued
        rank-major, rank 0's second kernel, new to the process, then waits for rank 0's first, which waits for
        rank 1's first, which the blocked host thread has not launched yet, until the timeout (seen on the H200,
        2026-12-02: every rank-major sweep timed out at its first staged call). Graph replays are safe: a
        graph's kernels are loaded when it is instantiated."""
        ops = _ext.ops()
        _require_cuda()
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        comms = []
        for rank in range(world_size):
            comm = cls.__new__(cls)
            comm.group = None
            comm._set_fields(rank, world_size, device, max_numel, dtype, "device", timeout_s, warn_after_s,
                             on_timeout, transport)
            comm.islands = comm._check_arguments(max_numel, dtype, islands, link, "device", on_timeout, transport)
            comm.num_islands = len(comm.islands) if comm.islands else 1
            comm.link = Link(link) if link != "auto" else Link.PCIE
            comm.use_pdl = False  # W streams of one process: no programmatic edges between the ranks' launches
            comms.append(comm)
        try:
            for comm in comms:
                comm._handle = int(ops.ws_create(*comm._config(comm.islands).create_args()))
            ops.ws_link_local([c._handle for c in comms])
            local = construction.local_launch_limits(ops, comms[0]._handle, device)
            budget = local["sm"] // world_size
            if budget < 1:
                raise IpcAllReduceError(f"{world_size} ranks cannot be co-resident on {local['sm']} SMs")
            share = {**local, "sm": budget, "capacity": [c // world_size for c in local["capacity"]],
                     "reason": local["reason"] + f" (local group: a {world_size}th of the GPU per rank)"}
            agreed = construction.agree_launch_limits([share])
            for comm in comms:
                ops.ws_set_launch_limits(comm._handle, agreed["sm_budget"], agreed["capacity"])
                comm._set_launch_limits(agreed)
                comm._start(ops)
        except Exception:
            close_local_group(comms)
            raise
        return comms

    def _set_fields(self, rank, world_size, device, max_numel, dtype, memory, timeout_s, warn_after_s, on_timeout,
                    transport) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.max_numel = int(max_numel)
        self.dtype = dtype
        self.memory = memory
        self.timeout_s = float(timeout_s) if timeout_s is not None else seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
        self.warn_after_s = (
            float(warn_after_s) if warn_after_s is not None else seconds_from_env(WARN_ENV, DEFAULT_WARN_S)
        )
        # Programmatic dependent launch lets our launch overlap the previous kernel (csrc/ar_protocol.cuh,
        # pdl_wait_and_release). Needs SM90+; both targets (sm_90a, sm_120a) have it.
        self.use_pdl = setting(PDL_ENV, "1") != "0"
        self.on_timeout = on_timeout
        self.transport = transport
        self.shm_dir = setting(construction.SHM_DIR_ENV).strip() or construction.DEFAULT_SHM_DIR
        self.abort_after_s = seconds_from_env(ABORT_AFTER_ENV, DEFAULT_ABORT_AFTER_S)
        # The one-shot bound of this workspace (host memory: the seed bound at 4 and 8 ranks, see policy.py).
        self.oneshot_max_numel = self.max_numel  # the one-shot slots' bound (policy.oneshot_max_numel)
        # Fused one-shot with a row over a cluster: the sizes the group launches, and why.
        self.fused_clusters: dict = {"clusters": [], "reason": "not checked yet"}
        self.sm_budget = 0
        self.probe_rounds = 0
        self.probe_read_rounds: tuple[int, ...] = ()  # which of them load from the peers (csrc/probe.cu)
        self._handle = 0
        self._watchdog: Watchdog | None = None
        self._shape: WorkspaceShape | None = None
        self.limits: policy.KernelLimits | None = None  # the library's, once built

    def _check_arguments(self, max_numel, dtype, islands, link, memory, on_timeout, transport):
        """Step 1 of the construction, local to a rank: raises on a bad argument; returns the islands normalised."""
        limits = policy.kernel_limits()  # the kernels built (from these sources: their enum codes are checked)?
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            _require_cuda()
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be bfloat16 or float16, got {dtype}")
        if self.world_size not in policy.WORLD_SIZES:
            raise ValueError(f"world size must be 1, 2, 4 or 8, got {self.world_size}")
        if self.max_numel <= 0 or self.max_numel % limits.elems_per_pack:
            raise ValueError(f"max_numel must be a positive multiple of {limits.elems_per_pack}, got {max_numel}")
        if not 0 < self.timeout_s < 1e9:  # also rejects nan
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        if not 0 < self.warn_after_s < 1e9:
            raise ValueError(f"warn_after_s must be > 0 seconds, got {self.warn_after_s}")
        if link not in ("auto", "nvlink", "pcie"):
            raise ValueError(f"link must be 'auto', 'nvlink' or 'pcie', got {link!r}")
        if memory not in (m.value for m in Memory):
            raise ValueError(f"memory must be 'device' or 'host', got {memory!r}")
        if on_timeout not in ON_TIMEOUT_MODES:
            raise ValueError(f"on_timeout must be 'trap' or 'exit', got {on_timeout!r}")
        if transport != AUTO:
            _transport(transport)
        if self.abort_after_s < 0:
            raise ValueError(f"{ABORT_AFTER_ENV} must be >= 0 seconds (0: off), got {self.abort_after_s}")
        self.oneshot_max_numel = policy.oneshot_max_numel(self.world_size, memory, self.max_numel, limits)
        groups = construction.validate_islands(islands, self.world_size)
        if memory == "host" and groups:
            raise ValueError("islands need memory='device': through host memory every pair is one hop")
        _require_cuda()  # and something to run them on (kernels_available() only says the library loads)
        return groups

    def _config(self, groups) -> construction.Config:
        return construction.Config(
            self.device.index, self.rank, self.world_size, self.max_numel, self.oneshot_max_numel, self.timeout_s,
            self.warn_after_s, self.on_timeout == "trap", groups, Memory(self.memory),
            self.shm_dir if self.memory == "host" else "",
        )

    def _set_launch_limits(self, agreed: dict) -> None:
        self.sm_budget = int(agreed["sm_budget"])
        self.fused_clusters = {"clusters": list(agreed["clusters"]), "reason": agreed["reason"]}

    def _start(self, ops) -> None:
        """The built workspace's host side: its shape, the watchdog, the log line."""
        self.sm_count = int(ops.ws_sm_count(self._handle))
        self.limits = policy.kernel_limits()
        self._shape = WorkspaceShape(
            self.world_size, self.memory, self.link, self.num_islands,
            self.oneshot_max_numel * policy.ELEMENT_BYTES, tuple(self.fused_clusters["clusters"]), self.sm_budget)
        self._watchdog = Watchdog.at(
            self.rank, int(ops.ws_error_record_address(self._handle)), int(ops.ws_slow_record_address(self._handle)),
            timeout_s=self.timeout_s, on_timeout=self.on_timeout, abort_after_s=self.abort_after_s,
            context_alive=self._context_alive)
        self._watchdog.start()
        logger.info(
            "IpcAllReduce rank %d/%d on %s: memory=%s link=%s islands=%s max_numel=%d timeout=%.1fs (%s) warn=%.1fs; "
            "launch: %d SMs (group minimum), fused rows %s",
            self.rank, self.world_size, self.device, self.memory, self.link.value, self.islands, self.max_numel,
            self.timeout_s, self.on_timeout, self.warn_after_s, self.sm_budget, self.describe_fused_launch(),
        )

    def _context_alive(self) -> bool:
        """For the watchdog: False once closed; raises once a trap has ended the CUDA context."""
        if self._handle == 0:
            return False
        _ext.ops().ws_calls_completed(self._handle)
        return True

    def describe_fused_launch(self) -> str:
        """For logs: how the fused one-shot spreads a few rows (cluster launch, or its one-CTA fallback)."""
        clusters = self.fused_clusters["clusters"]
        if clusters:
            sizes = "/".join(map(str, sorted(clusters, reverse=True)))
            return f"over {sizes}-CTA clusters ({self.fused_clusters['reason']})"
        return (f"one CTA per row, the cluster kernel's bits without clusters (cluster launch not used: "
                f"{self.fused_clusters['reason']})")

    # ----------------------------------------------------------------------------------------------------
    # What this workspace runs: pure functions of shape, dtype, contiguity and its agreed attributes, so every
    # rank answers the same.
    @property
    def shape(self) -> WorkspaceShape:
        """What this workspace runs (agreed by its ranks; policy.refusal decides against it)."""
        if self._shape is None:
            raise IpcAllReduceError("IpcAllReduce is not built")
        return self._shape

    def supports(self, inp: torch.Tensor) -> bool:
        return (
            self._handle != 0
            and inp.is_cuda
            and inp.device == self.device
            and inp.dtype in SUPPORTED_DTYPES
            and inp.is_contiguous()
            and 0 < inp.numel() <= self.max_numel
            and inp.numel() % self.limits.elems_per_pack == 0
        )

    def admits_fused(self, rows: int, hidden: int, dtype: torch.dtype) -> bool:
        """supports_add_rmsnorm's shape rule without a tensor (interim)."""
        return (dtype in SUPPORTED_DTYPES and 0 < rows * hidden <= self.max_numel
                and hidden % self.limits.elems_per_pack == 0 and hidden <= self.limits.max_fused_hidden)

    def supports_add_rmsnorm(self, inp: torch.Tensor, residual: torch.Tensor | None = None,
                             weight: torch.Tensor | None = None) -> bool:
        """supports(inp) for the fused op: [rows, hidden] with a hidden size the fused kernels take; and, when
        given, a residual like `inp` and a weight of [hidden] on its device and of its dtype."""
        if not (self.supports(inp) and inp.dim() == 2):
            return False
        hidden = inp.shape[-1]
        if hidden % self.limits.elems_per_pack or hidden > self.limits.max_fused_hidden:
            return False
        if residual is not None and (residual.shape != inp.shape or residual.dtype != inp.dtype
                                     or residual.device != inp.device):
            return False
        return weight is None or (tuple(weight.shape) == (hidden,) and weight.dtype == inp.dtype
                                  and weight.device == inp.device)

    def seed_route(self, nbytes: int, transport: str | Transport | None = None) -> Route:
        """The route of a message of `nbytes` bytes before anything was measured (policy.seed_route), over this
        workspace's transport unless `transport` is given."""
        chosen = transport if transport is not None and transport != AUTO else self.transport
        return policy.seed_route(nbytes, self.shape, policy.SEED_TRANSPORT if chosen == AUTO else _transport(chosen))

    # ----------------------------------------------------------------------------------------------------
    # The checked ops
    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None, *, route: Route | None = None,
                   variant=None, transport=None, blocks: int | None = None,
                   threads: int | None = None, window: int | None = None) -> torch.Tensor:
        """Out-of-place sum over the group. `inp` is never written. `route`: the launch (e.g. a routing table's);
        without one, the seed route of this size. `variant`, `transport`, `blocks` (the CTA cap), `threads` and
        `window` (staged push's passes in flight) replace that field of the route (tests and benchmarks). The
        same on every rank."""
        route = self._route(inp, route, variant=variant, transport=transport, ctas=blocks, threads=threads,
                            window=window)
        why = self.refusal(inp, route, fused=False, outs=(out,))
        if why:
            raise ValueError(f"IpcAllReduce cannot run this call: {why}")
        return self.launch(route, inp, out)

    def all_reduce_add_rmsnorm(
        self,
        inp: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        norm_out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        *,
        route: Route | None = None,
        variant=None,
        transport=None,
        blocks: int | None = None,
        cluster: int | None = None,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual_out = all_reduce(inp) + residual; norm_out = rmsnorm(residual_out) * weight.

        `inp` and `residual` are never written; both outputs are fresh tensors unless given. With the
        two-shot and island variants the owner of each slice adds its own `residual`: tensor parallelism
        replicates the residual on every rank, which is what makes that the caller's residual.

        `route`, `variant`, `transport`, `blocks`, `window` as for all_reduce; `cluster` (fused one-shot: CTAs per
        row, 1, 2, 4 or 8) replaces the route's (None: the kernels' own rule). The same on every rank.
        """
        route = self._route(inp, route, variant=variant, transport=transport, ctas=blocks, cluster=cluster,
                            window=window)
        why = self.refusal(inp, route, fused=True, residual=residual, weight=weight, outs=(norm_out, residual_out))
        if why:
            raise ValueError(f"IpcAllReduce cannot run this call: {why}")
        return self.launch_fused(route, inp, residual, weight, eps, norm_out, residual_out)

    def _route(self, inp: torch.Tensor, route: Route | None, **fields) -> Route:
        """The route a checked op runs: `route`, else the seed route of this size; each given field replaces it."""
        given = {name: value for name, value in fields.items() if value is not None}
        if route is None:
            route = self.seed_route(inp.numel() * inp.element_size(), given.pop("transport", None))
        if "variant" in given:
            given["variant"] = Variant(given["variant"])
        if "transport" in given:
            given["transport"] = _transport(given["transport"])
        return dataclasses.replace(route, **given) if given else route

    def refusal(self, inp: torch.Tensor, route: Route, *, fused: bool, residual: torch.Tensor | None = None,
                weight: torch.Tensor | None = None, outs=()) -> str | None:
        """The one Python check of a call's arguments: why this workspace cannot run `route` on these tensors, or
        None. Raises nothing but the workspace's own timeout (a poisoned or trapped workspace runs nothing)."""
        self._check_usable()
        if fused:
            if not self.supports_add_rmsnorm(inp, residual, weight):
                return (f"the fused op takes [rows, hidden] with hidden a multiple of {self.limits.elems_per_pack} "
                        f"up to {self.limits.max_fused_hidden}, the residual like the input and the weight "
                        f"[hidden], on this workspace's device and dtype ({self._describe(inp)}); check "
                        "supports_add_rmsnorm() first")
        elif not self.supports(inp):
            return f"this workspace cannot take the tensor ({self._describe(inp)}); check supports() first"
        for out in outs:
            if out is not None and (out.shape != inp.shape or out.dtype != inp.dtype or not out.is_contiguous()
                                    or out.device != inp.device):
                return "every output must be contiguous, with the input's shape, dtype and device"
        return policy.refusal(self.shape, route, inp.numel() * inp.element_size(), fused=fused, limits=self.limits)

    # ----------------------------------------------------------------------------------------------------
    # The launches, for callers that checked their arguments with refusal()
    def launch(self, route: Route, inp: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """all_reduce's launch of `route`, without its argument check (`refusal(inp, route, fused=False)` is
        None: the caller checked)."""
        self._check_usable()
        result = torch.empty_like(inp) if out is None else out
        target = result if _aligned(result) else torch.empty_like(inp)
        nbytes = inp.numel() * inp.element_size()
        ctas = policy.cta_cap(route, self.shape)
        _ext.ops().all_reduce(
            self._handle, _aligned_copy(inp), target, int(route.variant),
            route.threads or policy.plain_threads(nbytes, route.transport, ctas=ctas, limits=self.limits), ctas,
            self.use_pdl,
            *_trailing_args(route),
        )
        if target is not result:
            result.copy_(target)
        return result

    def launch_fused(self, route: Route, inp: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     norm_out: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """all_reduce_add_rmsnorm's launch of `route`, without its argument check (`refusal(inp, route,
        fused=True, ...)` is None: the caller checked)."""
        self._check_usable()
        outs = [torch.empty_like(inp) if given is None else given for given in (norm_out, residual_out)]
        targets = [o if _aligned(o) else torch.empty_like(inp) for o in outs]
        _ext.ops().all_reduce_add_rmsnorm(
            self._handle, _aligned_copy(inp), _aligned_copy(residual.contiguous()),
            _aligned_copy(weight.contiguous()), float(eps), targets[0], targets[1], int(route.variant),
            policy.cta_cap(route, self.shape), self.use_pdl, route.cluster or 0, *_trailing_args(route),
        )
        for o, t in zip(outs, targets, strict=True):
            if o is not t:
                o.copy_(t)
        return outs[0], outs[1]

    # ----------------------------------------------------------------------------------------------------
    def close(self, *, collective: bool = True, barrier_timeout_s: float = CLOSE_BARRIER_TIMEOUT_S) -> None:
        """Release the IPC mappings, the slab and the host records; idempotent.

        Collective by default (every rank calls it at the same point): wait for this rank's calls to finish,
        unmap the peers' slabs, wait until every rank has unmapped ours (a gloo barrier bounded by
        `barrier_timeout_s`), and only then free our slab: CUDA leaves freeing an allocation that another
        process still maps undefined. With `collective=False`, or after a kernel timeout (the CUDA context is
        then unusable and peers may be dead), the same steps run locally, without the barrier."""
        if self.group is None and self._handle:
            raise IpcAllReduceError(
                "a workspace of IpcAllReduce.local_group closes with its group: close_local_group()"
            )
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
                dist.monitored_barrier(self.group, timeout=datetime.timedelta(seconds=barrier_timeout_s))
            except Exception as exc:
                logger.warning(
                    "IpcAllReduce rank %d: not every rank confirmed within %.0f s that it unmapped this rank's slab "
                    "(%s); freeing it anyway", self.rank, barrier_timeout_s, exc,
                )
        try:
            self._release()
        except Exception as exc:
            if not context_dead:
                raise
            # After a trap every CUDA call of this process fails; the driver reclaims the memory with the process.
            logger.warning("IpcAllReduce rank %d: freeing the workspace after a kernel trap failed (%s); the CUDA "
                           "context is gone and its memory is released when the process ends", self.rank, exc)

    def timeout_error(self) -> IpcAllReduceTimeoutError | None:
        """The timeout a kernel of this workspace recorded, if any (a CPU read; works after the trap)."""
        return self._watchdog.timeout_error() if self._watchdog is not None else None

    def slow_wait(self) -> tuple[int, int, str, float] | None:
        """The latest slow wait a kernel reported (csrc/ar_protocol.cuh I9): (call, peer, phase, seconds)."""
        return self._watchdog.slow_wait() if self._watchdog is not None else None

    def synchronize(self) -> None:
        """torch.cuda.synchronize for this device, turning a kernel timeout into IpcAllReduceTimeoutError (in trap
        mode the synchronize fails and the record says why; in exit mode it succeeds and the record is read)."""
        try:
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # RuntimeError, or torch.AcceleratorError where torch has it
            err = self.timeout_error()
            if err is not None:
                raise err from exc
            raise
        err = self.timeout_error()
        if err is not None:
            raise err

    # Debug views for tests (each synchronizes the device).
    def scratch_dirty_count(self) -> int:
        """Half-words of this rank's scratch that are not empty; 0 after every completed call (I4)."""
        return int(_ext.ops().ws_dirty_halves(self._handle))

    def sequence(self) -> int:
        """Calls completed on this workspace, as counted on the device."""
        return int(_ext.ops().ws_sequence(self._handle))

    def calls_completed(self) -> int:
        """Calls completed on this workspace, counted on the device (CUDA-graph replays included), read without
        synchronizing: safe from a monitoring thread while the serving stream runs. May lag calls in flight."""
        if self._handle == 0:
            raise IpcAllReduceError("IpcAllReduce is closed")
        return int(_ext.ops().ws_calls_completed(self._handle))

    # ----------------------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        err = self.timeout_error()
        if err is not None:
            raise err
        if self._handle == 0:
            raise IpcAllReduceError("IpcAllReduce is closed")

    def _release(self) -> None:
        if self._watchdog is not None:
            self._watchdog.forget_records()  # both records live in the pinned block ws_destroy frees
        if self._handle:
            handle, self._handle = self._handle, 0
            construction.destroy(_ext.ops(), handle)

    def _describe(self, t: torch.Tensor) -> str:
        return (
            f"shape={tuple(t.shape)} dtype={t.dtype} device={t.device} contiguous={t.is_contiguous()} "
            f"numel={t.numel()} max_numel={self.max_numel}"
        )


def close_local_group(comms: list[IpcAllReduce]) -> None:
    """Close a group IpcAllReduce.local_group made: wait for the device, then free every rank's workspace (each
    maps the others' slabs, so they go together)."""
    for comm in comms:
        if comm._watchdog is not None:
            comm._watchdog.stop()
    try:
        torch.cuda.synchronize()
    finally:
        for comm in comms:
            comm._release()


def _trailing_args(route: Route) -> tuple:
    """The launch fields both ops take last, in their order (csrc/torch_bindings.cpp, TORCH_LIBRARY)."""
    return (route.transport.code, route.window or 0)


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA driver/GPU: torch.cuda.is_available() is False in this process (no NVIDIA driver, one too old "
            f"for torch's CUDA {torch.version.cuda}, or no visible GPU; check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        )


def _transport(value) -> Transport:
    try:
        return Transport(getattr(value, "value", value))
    except ValueError:
        raise ValueError(f"transport must be 'push', 'staged', 'pull' or 'auto', got {value!r}") from None


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    # A view at an odd offset is a local property, not a group-wide one: copy rather than decline.
    return t if _aligned(t) else t.clone()

