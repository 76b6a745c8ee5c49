"""`IpcAllReduce`: the CUDA IPC workspace of one process group and the two ops that use it.

Construction is collective over a CPU (gloo) process group: every step records its outcome on each rank,
the outcomes are gathered, and every rank raises together if any rank failed, so no rank is left waiting in
a later collective for a peer that gave up. Arguments are checked to be identical on every rank.

Use (docs/design.md, "Kernel contract", has the full contract):
    ar = IpcAllReduce(gloo_group, device, max_numel=64 * 7168)
    out = ar.all_reduce(x)                                      # x is not written
    norm, res = ar.all_reduce_add_rmsnorm(x, residual, w, 1e-6) # fresh outputs unless given
    ar.close()

One workspace serves one stream at a time (protocol invariant I6 in csrc/ar_protocol.cuh): the calls of a
rank must be totally ordered. Capturing on a side stream and replaying on another stream is fine.
Every rank must make the same sequence of calls with the same shapes; `supports()` and the variant choice
are pure functions of group-identical inputs so that this holds by construction.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import secrets
import threading
import time

import torch
import torch.distributed as dist

from . import _ext, cluster_check
from .errors import (
    IpcAllReduceError,
    IpcAllReduceHostMemoryError,
    IpcAllReduceProbeError,
    IpcAllReduceTimeoutError,
)
from .link import local_gpu_has_nvlink
from .variants import (
    STAGED_MAX_CTAS,
    Link,
    Transport,
    Variant,
    choose_transport,
    choose_variant,
    oneshot_max_bytes,
    placement,
    validate_islands,
)

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# A late peer is not a dead one (csrc/ar_protocol.cuh, I9): in a server's first forward one rank can be tens of
# seconds behind its peers while Triton/DeepGEMM/torch.compile compile lazily on a cold cache. So the bound that
# ends a wait in IpcAllReduceTimeoutError is minutes, and a wait past WARN is logged (naming call, phase, peer)
# without failing anything.
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_WARN_S = 5.0
TIMEOUT_ENV = "SGL_SM120_AR_TIMEOUT_S"
CLOSE_BARRIER_TIMEOUT_S = 60.0
# The probe runs right after a gloo collective, so every rank's pushes land within milliseconds on a healthy
# fabric; a few seconds also covers ranks time-slicing one GPU in the tests.
PROBE_TIMEOUT_S = 5.0
# Debug switch for the tests (probe_drop_target): rank SRC's probe skips its writes to rank DST and corrupts its
# loads from DST, in every round, in one round, or in the read rounds only (a read path that returns garbage).
PROBE_DROP_ENV = "SGL_SM120_DEBUG_PROBE_DROP"
PROBE_DROP_READS = "read"
# csrc/ar_types.h ProbeOutcome, per (sender, receiver): in a read round the sender is the rank whose slab the
# receiver loaded from.
_PROBE_OUTCOMES = {
    1: "ok",
    2: "write never arrived",
    3: "wrong data arrived",
    4: "rank {receiver}'s loads from rank {sender} never returned the pattern",
    5: "rank {receiver}'s loads from rank {sender} returned wrong data",
}
WARN_ENV = "SGL_SM120_AR_WARN_S"
# Where the host-memory workspace's shared file lives: a tmpfs (/dev/shm by default).
SHM_DIR_ENV = "SGL_SM120_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"
SHM_ADVICE = (
    "enlarge it (docker run --shm-size=1g; Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm) or "
    f"point {SHM_DIR_ENV} at a larger tmpfs"
)
# Tests only: skip the size check so that the allocation itself meets a full tmpfs (csrc/workspace.cu).
SHM_NO_PRECHECK_ENV = "SGL_SM120_DEBUG_SHM_NO_PRECHECK"
# What a timed-out wait does (csrc/ar_protocol.cuh I7): "trap" ends the CUDA context, "exit" poisons the workspace.
ON_TIMEOUT_MODES = ("trap", "exit")
# Trap mode's backstop: a trap was seen not to reach every process when several share one GPU (issue 22). If a
# kernel recorded a timeout this long ago and the CUDA context still answers (the trap never arrived), the
# watchdog aborts the process rather than leave it hanging in a synchronize. 0 switches the backstop off.
ABORT_AFTER_ENV = "SGL_SM120_AR_ABORT_AFTER_S"
DEFAULT_ABORT_AFTER_S = 30.0


def probe_drop_target(rank: int, environ=None, round_index: int | None = None, memory: str = "device",
                      reads: bool | None = None) -> int:
    """The peer this rank's probe fails with (debug switch) in `round_index` (None: any round), else -1.

    SRC:DST[:ROUND|:read][@MEMORY]: in a write round rank SRC skips its probe writes to DST; in a read round
    (`reads`: whether `round_index` is one; None: unknown, any) rank SRC's loads from DST see a wrong pattern
    (csrc/probe.cu). ROUND is a round number, or `read` for every read round (the write rounds come first, so
    without it a drop fails a write round). The switch stands for what ACS redirection or a translating IOMMU do
    to P2P traffic, so by default it applies to device-memory workspaces only (MEMORY device); a host-memory
    workspace, which crosses no P2P path, is probed untouched, as the overlay's retry in host memory needs. @host
    or @any make the host-memory probe fail too (its own tests)."""
    raw = (os.environ if environ is None else environ).get(PROBE_DROP_ENV, "").strip()
    if not raw:
        return -1
    spec, _, applies_to = raw.partition("@")
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or applies_to not in ("", "device", "host", "any"):
            raise ValueError
        src, dst = int(parts[0]), int(parts[1])
        when = parts[2] if len(parts) == 3 else None
        if when is not None and when != PROBE_DROP_READS:
            int(when)
    except ValueError:
        raise ValueError(
            f"{PROBE_DROP_ENV}={raw!r} must be SRC:DST, SRC:DST:ROUND or SRC:DST:{PROBE_DROP_READS} (rank and round "
            "numbers), optionally followed by @device (the default), @host or @any"
        ) from None
    if (applies_to or "device") not in (memory, "any"):
        return -1
    if src != rank:
        return -1
    if when == PROBE_DROP_READS:
        if reads is False:
            return -1
    elif when is not None and round_index is not None and int(when) != round_index:
        return -1
    return dst


def failed_probe_pairs(outcomes_by_receiver: list[list[int]], where: str = "") -> list[tuple[int, int, str]]:
    """(sender, receiver, what) for every pair whose probe pack did not arrive intact (`where`: the round); in a
    read round the receiver loaded from the sender's slab."""
    suffix = f" ({where})" if where else ""
    return [
        (sender, receiver,
         _PROBE_OUTCOMES.get(outcome, "outcome {outcome}").format(sender=sender, receiver=receiver, outcome=outcome)
         + suffix)
        for receiver, row in enumerate(outcomes_by_receiver)
        for sender, outcome in enumerate(row)
        if sender != receiver and outcome != 1
    ]


def plain_threads(nbytes: int) -> int:
    """CTA size of the plain kernels: more, smaller CTAs while latency dominates, larger ones for bandwidth
    (2x H200: 256 threads best up to [16, 7168] bf16, 512 from [64, 7168] on)."""
    return 256 if nbytes <= 256 * 1024 else 512


MAX_FUSED_HIDDEN = 65536  # kMaxFusedHidden in csrc/ar_launch.h: the fused kernels give a row one CTA
MAX_PLAIN_THREADS = 512  # kPlainMaxThreads in csrc/ar_launch.h
MEMORY_KINDS = {"device": 0, "host": 1}  # csrc/ar_launch.h enum class Memory
PDL_ENV = "SGL_SM120_AR_PDL"  # "0" launches without programmatic dependent launch
_PHASES = {1: "one-shot", 2: "reduce-scatter", 3: "cross-island", 4: "all-gather"}


class _SlowRecord(ctypes.Structure):
    # Mirrors struct SlowRecord in csrc/ar_types.h.
    _fields_ = [
        ("call_plus_one", ctypes.c_longlong),
        ("rank", ctypes.c_int),
        ("peer", ctypes.c_int),
        ("phase", ctypes.c_int),
        ("pad", ctypes.c_int),
        ("waited_ns", ctypes.c_longlong),
    ]


def _seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


class _ErrorRecord(ctypes.Structure):
    # Mirrors struct ErrorRecord in csrc/ar_protocol.cuh.
    _fields_ = [
        ("flag", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("peer", ctypes.c_int),
        ("phase", ctypes.c_int),
        ("seq", ctypes.c_longlong),
        ("waited_ns", ctypes.c_longlong),
    ]


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA driver/GPU: torch.cuda.is_available() is False in this process (no NVIDIA driver, one too old "
            f"for torch's CUDA {torch.version.cuda}, or no visible GPU; check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        )


def _joint_check(group, local_error: str | None, step: str) -> None:
    """Gather every rank's outcome of `step`; raise the same error on every rank if any failed."""
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, local_error, group=group)
    failed = {r: e for r, e in enumerate(outcomes) if e}
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        # A host-memory workspace that does not fit its tmpfs gets its own type: the overlay names the folder.
        kind = IpcAllReduceHostMemoryError if any("host memory:" in e for e in failed.values()) else IpcAllReduceError
        raise kind(f"IpcAllReduce {step} failed ({detail})")


def agree_launch_limits(locals_: list[dict]) -> dict:
    """The launch limits every rank uses, from every rank's own (a pure function of the gathered list, so every
    rank gets the same): the smallest SM count, and per cluster size the smallest capacity, 0 for every size
    unless every rank's cluster check passed. A group mixing two SKUs thus launches one grid shape everywhere."""
    clusters_ok = all(entry["clusters_ok"] for entry in locals_)
    capacity = [min(entry["capacity"][i] for entry in locals_) if clusters_ok else 0 for i in range(3)]
    reasons = sorted({f"rank {r}: {entry['reason']}" for r, entry in enumerate(locals_) if not entry["clusters_ok"]})
    return {
        "sm_budget": min(entry["sm"] for entry in locals_),
        "capacity": capacity,
        "clusters": [c for c, cap in zip(cluster_check.CLUSTER_SIZES, capacity, strict=True) if cap > 0],
        "reason": "; ".join(reasons) if reasons else locals_[0]["reason"],
    }


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
        transport: str = "auto",
    ):
        """memory="device": each rank's scratch in its GPU, reached by peers over CUDA IPC/P2P (NVLink or PCIe).
        memory="host": no P2P needed (GeForce cards): the scratch of every rank in one shared file on a tmpfs
        (SGL_SM120_SHM_DIR, default /dev/shm), pinned and mapped into every GPU; all ranks on one host; no islands.
        Same ops, same results.
        on_timeout (csrc/ar_protocol.cuh I7): "trap" (default) ends the CUDA context of a rank whose wait timed
        out, so no wrong result flows on; "exit" records the timeout, poisons the workspace (every later call
        does nothing and raises) and keeps the context usable: for tests and measurements, where the caller
        checks synchronize().
        transport: "push", "staged", "pull" (csrc/transports/), or "auto": choose_transport's choice per call (push
        until the tuner measures); every call can also force one (`transport=`). Results are bit for bit the
        same whichever transport runs."""
        self.group = group
        self._set_fields(dist.get_rank(group), dist.get_world_size(group), device, max_numel, dtype, memory,
                         timeout_s, warn_after_s, on_timeout, transport)

        # Step 1: arguments, checked locally, then compared across ranks.
        error = None
        groups = None
        try:
            groups = self._check_arguments(max_numel, dtype, islands, link, memory, on_timeout, transport)
            probe_drop_target(self.rank)  # a malformed debug switch fails here, on every rank
        except Exception as exc:  # every rank must learn about it: see _joint_check
            error = f"{type(exc).__name__}: {exc}"
        _joint_check(group, error, "argument check")
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

        # Step 3: local slab (device memory), or the group's shared buffer (host memory).
        ops = _ext.ops()
        if memory == "host":
            self._create_host_workspace(ops, groups)
        else:
            self._create_device_workspace(ops, groups)
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
        transport: str = "auto",
    ) -> list[IpcAllReduce]:
        """Tests and benchmarks (issue 17): the whole group in THIS process, one workspace per rank on one GPU,
        each seeing the others' slabs directly (no IPC, no process group). Launched together, on W streams or as
        W parallel branches of one CUDA graph, the ranks' kernels run concurrently, which ranks in separate
        processes sharing a GPU never do (they time-slice): a race in a protocol can show here. Co-residency:
        each rank gets SMs // W of the SMs (and a W-th of the cluster capacity), so the W ranks' CTAs fit the
        GPU at once; the mode refuses a world the GPU cannot hold so. The results are the same bits as in
        separate processes. Close the group with close_local_group(); a workspace of it alone is not closable.

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
                comm._handle = ops.ws_create(*comm._create_args(comm.islands, "device"))
            ops.ws_link_local([c._handle for c in comms])
            sm = int(ops.ws_sm_count(comms[0]._handle))
            budget = sm // world_size
            if budget < 1:
                raise IpcAllReduceError(f"{world_size} ranks cannot be co-resident on {sm} SMs")
            capacity = [int(c) // world_size for c in ops.ws_cluster_capacity(comms[0]._handle)]
            verdict = cluster_check.ClusterVerdict(False, "the GPU reports no cluster capacity", "checked")
            if any(capacity):
                verdict = cluster_check.verdict_for(
                    device.index, str(torch.cuda.get_device_properties(device).uuid), _ext.library_path()
                )
            if not verdict.ok:
                capacity = [0, 0, 0]
            for comm in comms:
                ops.ws_set_launch_limits(comm._handle, budget, capacity)
                comm.sm_budget = budget
                comm.fused_clusters = {
                    "clusters": [c for c, cap in zip(cluster_check.CLUSTER_SIZES, capacity, strict=True) if cap > 0],
                    "reason": verdict.reason + f" (local group: a {world_size}th of the GPU per rank)",
                }
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
        self.timeout_s = (
            float(timeout_s) if timeout_s is not None else _seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
        )
        self.warn_after_s = (
            float(warn_after_s) if warn_after_s is not None else _seconds_from_env(WARN_ENV, DEFAULT_WARN_S)
        )
        self.threads: int | None = None  # plain kernels' CTA size; None: plain_threads(nbytes)
        # Fused one-shot: CTAs per row (1, 2, 4, 8); None: the kernels' own rule (fused_cluster_size in
        # csrc/ar_kernels.cu). Must be the same on every rank, like every argument of a call.
        self.fused_cluster: int | None = None
        # Programmatic dependent launch lets our launch overlap the previous kernel (csrc/ar_protocol.cuh,
        # pdl_wait_and_release). Needs SM90+; both targets (sm_90a, sm_120a) have it.
        self.use_pdl = os.environ.get(PDL_ENV, "1") != "0"
        self.on_timeout = on_timeout
        self.transport = transport
        self.shm_dir = os.environ.get(SHM_DIR_ENV, "").strip() or DEFAULT_SHM_DIR
        self.abort_after_s = _seconds_from_env(ABORT_AFTER_ENV, DEFAULT_ABORT_AFTER_S)
        # The one-shot bound of this workspace (host memory: smaller at 4 and 8 ranks, see variants.py).
        self.oneshot_max_numel = self.max_numel
        # Fused one-shot with a row over a cluster: the sizes the group may launch, and why (issue 22).
        self.fused_clusters: dict = {"clusters": [], "reason": "not checked yet"}
        self.sm_budget = 0
        self.probe_rounds = 0
        self.probe_read_rounds: tuple[int, ...] = ()  # which of them load from the peers (csrc/probe.cu)
        self._handle = 0
        self._record = None
        self._slow = None
        self._last_slow_call = 0
        self._stop_watchdog = threading.Event()
        self._watchdog = None

    def _check_arguments(self, max_numel, dtype, islands, link, memory, on_timeout, transport):
        """Step 1 of the construction, local to a rank: raises on a bad argument; returns the islands normalised."""
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            _require_cuda()
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be bfloat16 or float16, got {dtype}")
        if not 1 <= self.world_size <= 8 or self.world_size not in (1, 2, 4, 8):
            raise ValueError(f"world size must be 1, 2, 4 or 8, got {self.world_size}")
        if self.max_numel <= 0 or self.max_numel % 8:
            raise ValueError(f"max_numel must be a positive multiple of 8, got {max_numel}")
        if not 0 < self.timeout_s < 1e9:  # also rejects nan
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        if not 0 < self.warn_after_s < 1e9:
            raise ValueError(f"warn_after_s must be > 0 seconds, got {self.warn_after_s}")
        if link not in ("auto", "nvlink", "pcie"):
            raise ValueError(f"link must be 'auto', 'nvlink' or 'pcie', got {link!r}")
        if memory not in MEMORY_KINDS:
            raise ValueError(f"memory must be 'device' or 'host', got {memory!r}")
        if on_timeout not in ON_TIMEOUT_MODES:
            raise ValueError(f"on_timeout must be 'trap' or 'exit', got {on_timeout!r}")
        if transport != "auto":
            _transport(transport)
        if self.abort_after_s < 0:
            raise ValueError(f"{ABORT_AFTER_ENV} must be >= 0 seconds (0: off), got {self.abort_after_s}")
        if memory == "host":
            limit = oneshot_max_bytes(self.world_size, Link.HOST) // 2 // 8 * 8
            self.oneshot_max_numel = max(8, min(self.max_numel, limit))
        groups = validate_islands(islands, self.world_size)
        if memory == "host" and groups:
            raise ValueError("islands need memory='device': through host memory every pair is one hop")
        _ext.ops()  # kernels built?
        _require_cuda()  # and something to run them on (kernels_available() only says the library loads)
        return groups

    def _start(self, ops) -> None:
        """The built workspace's host side: its records, the watchdog, the log line."""
        self.sm_count = int(ops.ws_sm_count(self._handle))
        self.max_blocks = self.sm_budget
        self._record = _ErrorRecord.from_address(int(ops.ws_error_record_address(self._handle)))
        self._slow = _SlowRecord.from_address(int(ops.ws_slow_record_address(self._handle)))
        self._watchdog = threading.Thread(target=self._watch_for_timeouts, name="sgl-sm120-ar-watchdog", daemon=True)
        self._watchdog.start()
        logger.info(
            "IpcAllReduce rank %d/%d on %s: memory=%s link=%s islands=%s max_numel=%d timeout=%.1fs (%s) warn=%.1fs; "
            "launch: %d SMs (group minimum), fused rows %s",
            self.rank,
            self.world_size,
            self.device,
            self.memory,
            self.link.value,
            self.islands,
            self.max_numel,
            self.timeout_s,
            self.on_timeout,
            self.warn_after_s,
            self.sm_budget,
            self.describe_fused_launch(),
        )

    def _create_args(self, groups, memory: str, shared_name: str = "", shared_create: bool = False) -> tuple:
        flat = placement([list(range(self.world_size))], self.rank)
        isl = placement(groups, self.rank) if groups else ([], [], 0, 0)
        return (
            self.device.index, self.rank, self.world_size, self.max_numel, self.oneshot_max_numel, self.timeout_s,
            self.warn_after_s, self.on_timeout == "trap", *flat, *isl, MEMORY_KINDS[memory],
            self.shm_dir if memory == "host" else "", shared_name, shared_create,
        )

    def _create_host_workspace(self, ops, groups) -> None:
        """Agreed steps: rank 0 creates the shared file (sparse, after checking the tmpfs has room for all of it)
        and allocates its own slab; then every other rank allocates its own (posix_fallocate: a full tmpfs is a
        named error on that rank, never a SIGBUS, csrc/workspace.cu); then every rank pins the whole buffer; once
        all have, rank 0 removes the name, so nothing is left in the folder whatever happens later."""
        error = None
        try:
            need = int(ops.host_shared_bytes_for(self.world_size, self.max_numel, self.oneshot_max_numel))
            stat = os.statvfs(self.shm_dir)
            free = stat.f_bavail * stat.f_frsize
            if free < need and os.environ.get(SHM_NO_PRECHECK_ENV) != "1":
                error = (f"host memory: {self.shm_dir} has {free / 2**20:.1f} MiB free, the workspace needs "
                         f"{need / 2**20:.1f} MiB ({self.world_size} slabs of {need / self.world_size / 2**20:.1f} "
                         f"MiB); {SHM_ADVICE}")
        except Exception as exc:
            error = f"host memory: checking the free space of {self.shm_dir}: {type(exc).__name__}: {exc}"
        _joint_check(self.group, error, "host-memory workspace size check")
        names: list = [None] * self.world_size
        dist.all_gather_object(names, f"sgl_sm120_{os.getpid()}_{secrets.token_hex(6)}", group=self.group)
        shared_name = names[0]
        for creating in (True, False):
            error = None
            if (self.rank == 0) == creating:
                try:
                    self._handle = ops.ws_create(*self._create_args(groups, "host", shared_name, creating))
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            try:
                _joint_check(self.group, error, "host-memory workspace " + ("creation" if creating else "mapping"))
            except Exception:
                self._release()
                raise
        try:
            # One rank at a time, as every run that passed did. (The construction "hang" of 2026-12-02 first
            # blamed on all ranks pinning at once was rank 0 dying in the NUMA lookup, csrc/workspace.cu
            # numa_node_of; pinning in turn costs W small barriers at start-up and was kept.)
            for turn in range(self.world_size):
                error = None
                if self.rank == turn:
                    try:
                        ops.ws_register_shared(self._handle)
                    except Exception as exc:
                        error = f"{type(exc).__name__}: {exc}"
                _joint_check(self.group, error, f"pinning the host-memory workspace (rank {turn})")
            if self.rank == 0:
                ops.ws_unlink_shared(self._handle)
            self._agree_launch_limits(ops)
            if self.world_size > 1:
                self._probe_data_path(ops)
        except Exception:
            self._release()
            raise

    def _agree_launch_limits(self, ops) -> None:
        """Every rank's SM count, cluster capacities and cluster-check verdict, agreed (agree_launch_limits) and
        installed in the workspace, so every rank launches the same grids (issue 22)."""
        error, local = None, None
        try:
            capacity = [int(c) for c in ops.ws_cluster_capacity(self._handle)]
            verdict = cluster_check.ClusterVerdict(False, "the GPU reports no cluster capacity", "checked")
            if any(capacity):
                verdict = cluster_check.verdict_for(
                    self.device.index, str(torch.cuda.get_device_properties(self.device).uuid), _ext.library_path()
                )
            local = {"sm": int(ops.ws_sm_count(self._handle)), "capacity": capacity, "clusters_ok": verdict.ok,
                     "reason": verdict.reason}
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        _joint_check(self.group, error, "launch-limit check")
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, local, group=self.group)
        agreed = agree_launch_limits(everyone)
        ops.ws_set_launch_limits(self._handle, agreed["sm_budget"], agreed["capacity"])
        self.sm_budget = agreed["sm_budget"]
        self.fused_clusters = {"clusters": agreed["clusters"], "reason": agreed["reason"]}

    def describe_fused_launch(self) -> str:
        """For logs: how the fused one-shot spreads a few rows (cluster launch, or its one-CTA fallback)."""
        clusters = self.fused_clusters["clusters"]
        if clusters:
            sizes = "/".join(map(str, sorted(clusters, reverse=True)))
            return f"over {sizes}-CTA clusters ({self.fused_clusters['reason']})"
        return (f"one CTA per row, the cluster kernel's bits without clusters (cluster launch not used: "
                f"{self.fused_clusters['reason']})")

    def _create_device_workspace(self, ops, groups) -> None:
        error = None
        try:
            self._handle = ops.ws_create(*self._create_args(groups, "device"))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            _joint_check(self.group, error, "workspace allocation")
            group = self.group
            # Step 4: exchange IPC handles, open the peers' slabs.
            handles: list = [None] * self.world_size
            dist.all_gather_object(handles, bytes(ops.ws_ipc_handle(self._handle).tolist()), group=group)
            error = None
            if self.world_size > 1:
                try:
                    table = torch.tensor([list(h) for h in handles], dtype=torch.uint8)
                    ops.ws_open_peers(self._handle, table)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
            _joint_check(group, error, "opening peer IPC handles")
            self._agree_launch_limits(ops)
            if self.world_size > 1:
                self._probe_data_path(ops)
        except Exception:
            self._release()
            raise

    def _probe_data_path(self, ops) -> None:
        """Step 5: in rounds (csrc/probe.cu), every rank writes pattern packs at the edges of every area the
        kernels write in every peer's scratch, then loads pattern packs from the edges of every peer's pull area,
        through the kernels' own paths, and reports what arrived; all ranks agree after each round (which is also
        the barrier between rounds); the first failed round raises IpcAllReduceProbeError on every rank, naming
        the pairs and the area."""
        timeout = min(PROBE_TIMEOUT_S, self.timeout_s)
        self.probe_rounds = int(ops.ws_probe_rounds(self._handle))
        self.probe_read_rounds = tuple(r for r in range(self.probe_rounds)
                                       if bool(ops.ws_probe_round_reads(self._handle, r)))
        for round_index in range(self.probe_rounds):
            error, outcomes = None, None
            try:
                drop = probe_drop_target(self.rank, round_index=round_index, memory=self.memory,
                                         reads=round_index in self.probe_read_rounds)
                outcomes = [int(o) for o in ops.ws_probe(self._handle, timeout, round_index, drop)]
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            _joint_check(self.group, error, "data-path probe")
            table: list = [None] * self.world_size
            dist.all_gather_object(table, outcomes, group=self.group)
            failed = failed_probe_pairs(table, str(ops.ws_probe_round_name(self._handle, round_index)))
            if failed:
                # A write that is only slow could still land: unmap, let every rank do the same, then free (close()).
                ops.ws_close_peers(self._handle)
                dist.barrier(group=self.group)
                raise IpcAllReduceProbeError(failed)

    # ----------------------------------------------------------------------------------------------------
    # Eligibility: pure functions of shape, dtype, contiguity and immutable attributes (same on every rank).
    def supports(self, inp: torch.Tensor) -> bool:
        return (
            self._handle != 0
            and inp.is_cuda
            and inp.device == self.device
            and inp.dtype in SUPPORTED_DTYPES
            and inp.is_contiguous()
            and 0 < inp.numel() <= self.max_numel
            and inp.numel() % 8 == 0
        )

    def supports_add_rmsnorm(self, inp: torch.Tensor) -> bool:
        return self.supports(inp) and inp.dim() == 2 and inp.shape[-1] % 8 == 0 and inp.shape[-1] <= MAX_FUSED_HIDDEN

    def choose_variant(self, nbytes: int) -> Variant:
        return choose_variant(nbytes, self.world_size, self.link, self.num_islands)

    # ----------------------------------------------------------------------------------------------------
    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor | None = None, *, variant=None,
                   transport=None, blocks: int | None = None, window: int | None = None) -> torch.Tensor:
        """Out-of-place sum over the group. `inp` is never written. `blocks` caps the CTAs of the launch (None: the
        whole SM budget, staged push STAGED_MAX_CTAS; at most the SM budget either way); `window` (staged push: passes
        in flight before their pacing waits, 1 .. world - 1; None: the kernels' default); the same on every rank."""
        self._check_usable()
        if not self.supports(inp):
            raise ValueError(f"IpcAllReduce cannot take this tensor ({self._describe(inp)}); check supports() first")
        chosen = self._resolve_variant(variant, inp)
        how = self._resolve_transport(transport, inp)
        result = torch.empty_like(inp) if out is None else out
        if result.shape != inp.shape or result.dtype != inp.dtype or not result.is_contiguous():
            raise ValueError("out must be a contiguous tensor with inp's shape and dtype")
        target = result if _aligned(result) else torch.empty_like(inp)
        _ext.ops().all_reduce(
            self._handle,
            _aligned_copy(inp),
            target,
            int(chosen),
            min(self.threads or plain_threads(inp.numel() * inp.element_size()), MAX_PLAIN_THREADS),
            self._max_blocks(how, blocks),
            self.use_pdl,
            how.code,
            0 if window is None else window,
        )
        if target is not result:
            result.copy_(target)
        return result

    def all_reduce_add_rmsnorm(
        self,
        inp: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        norm_out: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        *,
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

        `blocks` and `window` as for all_reduce; `cluster` (fused one-shot: CTAs per row, 1, 2, 4 or 8; 0: the
        kernels' own rule) overrides the workspace's `fused_cluster` for this call. All the same on every rank.
        """
        self._check_usable()
        if not self.supports_add_rmsnorm(inp):
            raise ValueError(
                f"IpcAllReduce cannot take this tensor ({self._describe(inp)}); check supports_add_rmsnorm() first"
            )
        if residual.shape != inp.shape or residual.dtype != inp.dtype:
            raise ValueError("residual must have inp's shape and dtype")
        if weight.shape != (inp.shape[-1],) or weight.dtype != inp.dtype:
            raise ValueError(f"weight must be [{inp.shape[-1]}] of dtype {inp.dtype}")
        chosen = self._resolve_variant(variant, inp)
        how = self._resolve_transport(transport, inp)
        outs = []
        for given in (norm_out, residual_out):
            if given is None:
                outs.append(torch.empty_like(inp))
            elif given.shape != inp.shape or given.dtype != inp.dtype or not given.is_contiguous():
                raise ValueError("norm_out/residual_out must be contiguous with inp's shape and dtype")
            else:
                outs.append(given)
        targets = [o if _aligned(o) else torch.empty_like(inp) for o in outs]
        _ext.ops().all_reduce_add_rmsnorm(
            self._handle,
            _aligned_copy(inp),
            _aligned_copy(residual.contiguous()),
            _aligned_copy(weight.contiguous()),
            float(eps),
            targets[0],
            targets[1],
            int(chosen),
            self._max_blocks(how, blocks),
            self.use_pdl,
            _cluster(self.fused_cluster if cluster is None else cluster),
            how.code,
            0 if window is None else window,
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
        self._stop_watchdog.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2.0)
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
        rec = self._record
        if rec is None or not rec.flag:
            return None
        return IpcAllReduceTimeoutError(
            rec.rank, rec.peer, _PHASES.get(rec.phase, str(rec.phase)), rec.seq, rec.waited_ns / 1e9,
            context_lost=self.on_timeout == "trap",
        )

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
    def _resolve_variant(self, variant, inp: torch.Tensor) -> Variant:
        if variant is None:
            return self.choose_variant(inp.numel() * inp.element_size())
        chosen = Variant(variant)
        if chosen is Variant.ISLAND and self.num_islands < 2:
            raise ValueError("Variant.ISLAND needs a workspace created with islands")
        if chosen is Variant.ONESHOT and inp.numel() > self.oneshot_max_numel:
            raise ValueError(
                f"Variant.ONESHOT takes at most {self.oneshot_max_numel} elements in this workspace ({self.memory} "
                f"memory, {self.world_size} ranks), got {inp.numel()}"
            )
        return chosen

    def _resolve_transport(self, transport, inp: torch.Tensor) -> Transport:
        """The call's transport: forced per call, else the workspace's, else choose_transport (group-identical)."""
        if transport is None and self.transport != "auto":
            transport = self.transport
        if transport is None or transport == "auto":
            return choose_transport(inp.numel() * inp.element_size(), self.world_size, self.link)
        return _transport(transport)

    def _max_blocks(self, how: Transport, blocks: int | None = None) -> int:
        """The call's CTA cap: `blocks` where given (a tuned launch), else the whole budget, except that staged push
        paces every CTA and takes few of them (STAGED_MAX_CTAS). The same on every rank."""
        if blocks is not None:
            if isinstance(blocks, bool) or int(blocks) != blocks or blocks < 1:
                raise ValueError(f"blocks must be a positive integer, got {blocks!r}")
            return min(int(blocks), self.max_blocks)
        return min(self.max_blocks, STAGED_MAX_CTAS) if how is Transport.STAGED else self.max_blocks

    def _check_usable(self) -> None:
        err = self.timeout_error()
        if err is not None:
            raise err
        if self._handle == 0:
            raise IpcAllReduceError("IpcAllReduce is closed")

    def slow_wait(self) -> tuple[int, int, str, float] | None:
        """The latest slow wait a kernel reported (I9) as (call, peer, phase, seconds waited), or None. A CPU read
        of host-mapped memory; the record is re-read until it is the same before and after (the kernel writes
        `call_plus_one` last)."""
        rec = self._slow
        if rec is None:
            return None
        for _ in range(3):
            first = rec.call_plus_one
            if first == 0:
                return None
            found = (first - 1, rec.peer, _PHASES.get(rec.phase, str(rec.phase)), rec.waited_ns / 1e9)
            if rec.call_plus_one == first:
                return found
        return None

    def _watch_for_timeouts(self) -> None:
        # Log the timeout as soon as a kernel records it, so the server log names the missing peer even when
        # the CUDA error surfaces somewhere else first; log each slow wait once (I9), as a warning only.
        while not self._stop_watchdog.wait(0.1):
            err = self.timeout_error()
            if err is not None:
                logger.error("%s", err)
                if self.on_timeout == "trap" and self.abort_after_s > 0:
                    self._abort_if_trap_never_arrives(err)
                return
            slow = self.slow_wait()
            if slow is not None and slow[0] + 1 != self._last_slow_call:
                call, peer, phase, waited = slow
                self._last_slow_call = call + 1
                logger.warning(
                    "sgl_kernel_sm120 all-reduce on rank %d: call #%d has waited %.1f s in the %s phase for rank %d "
                    "(a peer still compiling or loading can be this late; the call fails with "
                    "IpcAllReduceTimeoutError only after %.0f s, %s)",
                    self.rank, call, waited, phase, peer, self.timeout_s, TIMEOUT_ENV,
                )

    def _abort_if_trap_never_arrives(self, err: IpcAllReduceTimeoutError) -> None:
        """Trap mode's backstop (ABORT_AFTER_ENV): the kernel trapped right after writing the record, so the CUDA
        context should fail at once. If it still answers abort_after_s later, the trap did not reach this process
        (seen with several processes time-slicing one GPU) and whatever waits on the GPU would wait forever: end the
        process, as PyTorch's NCCL watchdog does on a collective timeout, rather than hang."""
        deadline = time.monotonic() + self.abort_after_s
        while not self._stop_watchdog.wait(0.5):
            if self._handle == 0:
                return
            try:
                _ext.ops().ws_calls_completed(self._handle)  # fails once the trap has ended the context
            except Exception:
                return
            if time.monotonic() > deadline:
                logger.critical(
                    "%s The kernel trapped %.0f s ago but the CUDA error has not reached this process (%s); aborting "
                    "it so that nothing waits on it forever (%s=0 keeps it alive).",
                    err, self.abort_after_s, "seen when several processes share one GPU", ABORT_AFTER_ENV,
                )
                for handler in logging.getLogger().handlers + logger.handlers:
                    handler.flush()
                os.abort()

    def _release(self) -> None:
        if self._handle:
            handle, self._handle = self._handle, 0
            self._record = None
            self._slow = None  # both records live in the pinned block ws_destroy frees
            _ext.ops().ws_destroy(handle)

    def _describe(self, t: torch.Tensor) -> str:
        return (
            f"shape={tuple(t.shape)} dtype={t.dtype} device={t.device} contiguous={t.is_contiguous()} "
            f"numel={t.numel()} max_numel={self.max_numel}"
        )


def close_local_group(comms: list[IpcAllReduce]) -> None:
    """Close a group IpcAllReduce.local_group made: wait for the device, then free every rank's workspace (each
    maps the others' slabs, so they go together)."""
    for comm in comms:
        comm._stop_watchdog.set()
    try:
        torch.cuda.synchronize()
    finally:
        for comm in comms:
            if comm._watchdog is not None:
                comm._watchdog.join(timeout=2.0)
            comm._release()


def _transport(value) -> Transport:
    try:
        return Transport(getattr(value, "value", value))
    except ValueError:
        raise ValueError(f"transport must be 'push', 'staged', 'pull' or 'auto', got {value!r}") from None


def _cluster(value) -> int:
    """A fused call's cluster argument: None or 0 is the kernels' own rule."""
    if value is None:
        return 0
    if isinstance(value, bool) or value not in (0, 1, 2, 4, 8):
        raise ValueError(f"cluster must be 1, 2, 4 or 8 CTAs per row (0 or None: the kernels' rule), got {value!r}")
    return int(value)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    # A view at an odd offset is a local property, not a group-wide one: copy rather than decline.
    return t if _aligned(t) else t.clone()
