"""The dispatch policy of the kernels, as data: what one launch is (`Route`), what a built workspace can run as it
was measured (`refusal`), the routes used before anything was measured (`seed_route`), and every threshold the
dispatch uses. `IpcAllReduce` runs a `Route` it is given; the overlay's routing table stores them; the tuner
enumerates them.

Pure Python with no imports beyond the standard library: the overlay's routing table and its offline report import
it on machines without torch. The kernels' own limits (threads per CTA, the widest fused row, the largest grid)
are not copied here: `kernel_limits()` reads them, and the codes of the enums below, from the library this
process loads, on first use (that needs torch and the library), and refuses a library whose codes differ from
these enums (it would launch another variant or transport than the one asked for).

Every function here is a pure function of group-identical inputs, so every rank of a group answers the same: a
rank that launched another route than its peers would wait for data that never comes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
from collections.abc import Mapping
from typing import Any


class Variant(enum.IntEnum):
    """The schedule of a call. Codes: csrc/ar_launch.h enum class Variant (kernel_limits() checks them)."""

    ONESHOT = 0  # every rank pushes everything to everyone, reduces locally: one hop, (W-1)x bytes
    TWOSHOT = 1  # flat reduce-scatter to owners + all-gather: two hops, ~2x bytes
    ISLAND = 2  # reduce-scatter inside each island, fp32 exchange between twins, all-gather: three hops


class Transport(str, enum.Enum):
    """How a call's data travels (csrc/transports/; codes: csrc/ar_types.h enum Transport, append-only)."""

    PUSH = "push"  # every rank stores into every peer's scratch at once (posted writes)
    STAGED = "staged"  # the same stores in W-1 permutation passes, one destination per pass (few CTAs)
    PULL = "pull"  # every rank stores into its own slab, the peers load from it; readiness by flags

    @property
    def code(self) -> int:
        return _CODES[self]


class Memory(str, enum.Enum):
    """Where the scratch lives (codes: csrc/ar_launch.h enum class Memory)."""

    DEVICE = "device"  # each rank's slab in its GPU, reached by the peers over CUDA IPC / P2P
    HOST = "host"  # every rank's slab in one pinned shared host buffer mapped into every GPU (no P2P)

    @property
    def code(self) -> int:
        return _CODES[self]


class Link(str, enum.Enum):
    """What joins the GPUs: a hint for the seed variants only (a wrong answer costs speed, never correctness)."""

    NVLINK = "nvlink"
    PCIE = "pcie"
    HOST = "host"  # no P2P: every push goes to pinned host memory and every poll reads it (Memory.HOST)


_CODES: dict[enum.Enum, int] = {Transport.PUSH: 0, Transport.STAGED: 1, Transport.PULL: 2,
                                Memory.DEVICE: 0, Memory.HOST: 1}

WORLD_SIZES = (1, 2, 4, 8)  # the kernels are instantiated per world size (1: a no-op)
DTYPES = ("bfloat16", "float16")  # torch's names of the element types the kernels take
ELEMENT_BYTES = 2  # both of them
# Cluster sizes the fused one-shot launches (its cluster kernel is instantiated for these); spreading a row over
# one CTA (ROW_SPLITS' 1) is the grouped one-CTA kernel, which computes the same bits without a cluster.
CLUSTER_SIZES = (2, 4, 8)
ROW_SPLITS = (1, *CLUSTER_SIZES)
THREAD_GRAIN = 32  # a CTA size is whole warps

# ---------------------------------------------------------------------------------------------------------
# Seeds: what runs before anything was measured (--sm120-allreduce-tune off, tests, benchmarks). Every one of
# them is a starting point for the tuner, not a measurement of a PCIe SM120 box.

# Push for every size until the tuner measures another transport on the box.
SEED_TRANSPORT = Transport.PUSH
# Staged push paces its passes CTA by CTA and was meant for few CTAs (FlashInfer caps its staged ring at 4). On 1x
# H200, loopback, 2026-12-03 (benchmarks/results/transports_h200_loopback.json, `sweep`), 8 CTAs were up to 5x
# slower than the whole budget at rows 3 and 16 and never faster by more than 2%, so the seed launches staged push
# on the whole budget like the other transports; the tuner also tries this few-CTA cap, for the PCIe fabrics where
# fewer streams at once may win.
STAGED_FEW_CTAS = 8
# At 2 ranks one-shot beat two-shot at every size measured on 2x H200 (benchmarks/results/allreduce_h200_tp2.json).
# The 4- and 8-rank bounds are unmeasured: the NVLink one from the one-shot's (W-1)x traffic, the PCIe ones from
# published PCIe Gen5 P2P figures (all-to-all posted writes collapse on root complexes past a few tens of KB, so
# larger messages move to the staged schedules).
NVLINK_ONESHOT_MAX_BYTES = 512 * 1024
PCIE_ONESHOT_MAX_BYTES = {2: 1 << 62, 4: 32 * 1024, 8: 16 * 1024}
# Through host memory every byte crosses PCIe three times (the push, the reader's poll, and the reader's store
# that empties the slot, csrc/ar_protocol.cuh I11), and one-shot makes each rank read (W-1) payloads while
# two-shot reads ~2. At 2 ranks one-shot moves the same bytes in one hop, so it always wins there; the 4- and
# 8-rank bounds come from that arithmetic (a poll of host memory is a ~1 us round trip). A host-memory workspace
# sizes its one-shot slots by them (`oneshot_max_bytes`).
HOST_ONESHOT_MAX_BYTES = {2: 1 << 62, 4: 16 * 1024, 8: 8 * 1024}
# The plain kernels' CTA size: more, smaller CTAs while latency dominates, larger ones for bandwidth. Push and pull,
# 1x H200 loopback, 2026-12-03 (benchmarks/results/transports_h200_loopback.json, `sweep`, bf16 [rows, 7168]):
# 64 threads fastest or within 8% at rows 1 and 3 (43,008 B) for W = 2, 4, 8, where 256 were up to 1.5x slower;
# 128 fastest at rows 16 (229,376 B), where 64 were up to 1.9x slower. The switch between them sits between
# those measured sizes, at 64 KiB (not measured there). Past 256 KiB 512 threads (2x H200, 2026-11-29: 512 from
# [64, 7168] on). Staged push keeps 256 below that: its swept windows and caps ran at 256 threads only.
# Under a CTA cap too small for that many CTAs in one wave the size doubles until they fit (up to the kernels'
# largest): in one-process groups (a W-th of the SMs per rank, 1x H200, 2026-12-03,
# benchmarks/results/tuner_pick_h200_concurrent_session7_call1.json) the size-only seed was 1.10-1.24x off the best
# launch at W = 2 rows 16, W = 4 rows 3 and 16, W = 8 rows 3 and 16, and the one-wave size is the best one's there.
PLAIN_THREADS_TINY, PLAIN_THREADS_SMALL, PLAIN_THREADS_LARGE = 64, 128, 512
PLAIN_THREADS_STAGED_SMALL = 256
PLAIN_THREADS_TINY_BYTES = 64 * 1024
PLAIN_THREADS_SWITCH_BYTES = 256 * 1024


# ---------------------------------------------------------------------------------------------------------
# The kernels' own limits, from the library


@dataclasses.dataclass(frozen=True)
class KernelLimits:
    """What the loaded library's kernels take (csrc/ar_launch.h, csrc/ar_types.h)."""

    plain_max_threads: int  # threads per CTA of the plain kernels (kPlainMaxThreads)
    max_packs_per_thread: int  # the fused kernels' packs per thread (kMaxPacksPerThread)
    max_fused_hidden: int  # the widest row the fused kernels take (kMaxFusedHidden)
    max_world: int  # kMaxWorld
    max_ctas: int  # the largest grid, and SM count, a workspace keeps counters for (kMaxCounters)
    pack_bytes: int  # one vector store (kPackBytes)
    elems_per_pack: int  # kElemsPerPack: a tensor's element count and a row's width are multiples of it
    owner_block_packs: int  # the staged schedules' hand-over unit (kOwnerBlockPacks)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def parse_kernel_limits(text: str) -> KernelLimits:
    """The library's `kernel_limits()` JSON as KernelLimits; ValueError when it lacks a limit, or when a code of
    the library's enums is not this module's (the library was built from other sources than this package)."""
    raw = json.loads(text)
    if not isinstance(raw, Mapping) or not all(isinstance(v, int) for v in raw.values()):
        raise ValueError(f"kernel_limits() must be a JSON object of integers, got {text!r}")
    expected = {f"variant_{v.name.lower()}": int(v) for v in Variant}
    expected.update({f"transport_{t.value}": t.code for t in Transport})
    expected.update({f"memory_{m.value}": m.code for m in Memory})
    differing = {name: (code, raw.get(name)) for name, code in expected.items() if raw.get(name) != code}
    if differing:
        shown = ", ".join(f"{name} is {theirs} there, {ours} here"
                          for name, (ours, theirs) in sorted(differing.items()))
        raise ValueError(f"the kernel library's enum codes differ from sgl_kernel_sm120.policy's ({shown}): rebuild "
                         "the library from this checkout")
    fields = [f.name for f in dataclasses.fields(KernelLimits)]
    missing = [name for name in fields if name not in raw]
    if missing:
        raise ValueError(f"kernel_limits() lacks {missing}: rebuild the library from this checkout")
    return KernelLimits(**{name: int(raw[name]) for name in fields})


@functools.lru_cache(maxsize=1)
def kernel_limits() -> KernelLimits:
    """The limits of the library this process loads (loads it; KernelsNotBuiltError when it cannot)."""
    from . import _ext

    return parse_kernel_limits(str(_ext.ops().kernel_limits()))


# ---------------------------------------------------------------------------------------------------------
# A route: one launch


def _as_enum(kind: type[enum.Enum], value: Any) -> Any:
    if isinstance(value, kind):
        return value
    if kind is Variant and isinstance(value, str):
        try:
            return Variant[value]
        except KeyError:
            pass
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.name if kind is Variant else m.value for m in kind)
        raise ValueError(f"unknown {kind.__name__.lower()} {value!r} (known: {allowed})") from None


# The launch fields a route id names after variant/transport/memory, each as /<letter><number>, in this order.
LAUNCH_FIELDS = (("ctas", "b"), ("cluster", "c"), ("threads", "t"), ("window", "w"))


@dataclasses.dataclass(frozen=True)
class Route:
    """One launch of the kernels, every field that changes what runs. A launch field left None takes its seed
    rule at the call, from the workspace it runs on: `ctas` the whole SM budget,
    `cluster` the kernels' own rule (csrc/ar_kernels.cu fused_cluster_size), `threads` plain_threads(). A route
    that names them is exactly the launch that was measured."""

    variant: Variant
    transport: Transport = SEED_TRANSPORT
    memory: Memory = Memory.DEVICE
    ctas: int | None = None  # the launch's CTA cap
    cluster: int | None = None  # the fused one-shot's CTAs per row (ROW_SPLITS); fused calls only
    threads: int | None = None  # the plain kernels' CTA size; plain calls only
    # staged push: passes in flight before their pacing waits, 1 .. world - 1 (csrc/transports/staged_push.cuh);
    # None: the kernels' default (csrc/ar_launch.h kDefaultStagedWindow)
    window: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "variant", _as_enum(Variant, self.variant))
        object.__setattr__(self, "transport", _as_enum(Transport, self.transport))
        object.__setattr__(self, "memory", _as_enum(Memory, self.memory))
        for name, _ in LAUNCH_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} {value!r}: a positive number")
        if self.cluster is not None and (self.cluster not in ROW_SPLITS or self.variant is not Variant.ONESHOT):
            raise ValueError(f"cluster {self.cluster}: the fused one-shot spreads a row over {ROW_SPLITS} CTAs")
        if self.ctas is not None and self.cluster is not None and self.ctas < self.cluster:
            raise ValueError(f"ctas {self.ctas} cannot hold one cluster of {self.cluster} CTAs")
        if self.threads is not None and self.threads % THREAD_GRAIN:
            raise ValueError(f"threads {self.threads}: a CTA is whole warps of {THREAD_GRAIN}")
        if self.window is not None and self.transport is not Transport.STAGED:
            raise ValueError(f"window {self.window}: only staged push runs its passes in a window")

    @property
    def id(self) -> str:
        """'ONESHOT/push/device', then '/b94' for at most 94 CTAs, '/c8' for a row over an 8-CTA cluster,
        '/t256' for 256 threads per CTA, '/w2' for staged push with 2 passes in flight."""
        tail = "".join(f"/{letter}{getattr(self, name)}" for name, letter in LAUNCH_FIELDS
                       if getattr(self, name) is not None)
        return f"{self.variant.name}/{self.transport.value}/{self.memory.value}{tail}"

    @classmethod
    def parse(cls, text: str) -> Route:
        """The route of an id (ValueError naming what is wrong)."""
        parts = str(text).split("/")
        if len(parts) < 3:
            raise ValueError(f"bad route {text!r}: expected 'VARIANT/TRANSPORT/MEMORY[/bN][/cN][/tN][/wN]'")
        letters = [letter for _, letter in LAUNCH_FIELDS]
        launch: dict[str, int] = {}
        last = -1
        for part in parts[3:]:
            letter, number = part[:1], part[1:]
            if letter not in letters or not number.isdigit() or letters.index(letter) <= last:
                raise ValueError(f"bad route {text!r}: the launch parts are " +
                                 ", ".join(f"/{x}N" for x in letters) + ", each at most once, in that order")
            last = letters.index(letter)
            launch[LAUNCH_FIELDS[last][0]] = int(number)
        return cls(parts[0], parts[1], parts[2], **launch)


# ---------------------------------------------------------------------------------------------------------
# What a workspace runs


@dataclasses.dataclass(frozen=True)
class WorkspaceShape:
    """What a built workspace can run, agreed by its ranks (so the same on every rank)."""

    world_size: int
    memory: Memory
    link: Link
    num_islands: int = 1  # 2 or more: the workspace has islands (ISLAND runs)
    oneshot_max_bytes: int = 1 << 62  # the one-shot slots' bound (host memory at 4 and 8 ranks: the seed bound)
    clusters: tuple[int, ...] = ()  # cluster sizes every rank launches (its cluster check passed on every rank)
    sm_budget: int = 0  # CTAs a launch may use: the group's smallest SM count (0: not known yet)

    def __post_init__(self):
        object.__setattr__(self, "memory", _as_enum(Memory, self.memory))
        object.__setattr__(self, "link", _as_enum(Link, self.link))
        object.__setattr__(self, "clusters", tuple(sorted(int(c) for c in self.clusters)))

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "memory": self.memory.value, "link": self.link.value,
                "clusters": list(self.clusters)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> WorkspaceShape:
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})


def refusal(shape: WorkspaceShape, route: Route, nbytes: int, *, fused: bool, limits: KernelLimits) -> str | None:
    """Why the workspace of `shape` cannot run `route` on a message of `nbytes` bytes as the route says, or None
    when it can. A refused route goes to NCCL, never to another launch: the kernels would otherwise clamp or fall
    back to a launch nobody measured (a cluster size the workspace does not launch runs the one-CTA kernel, a CTA
    cap past the budget runs the budget). Any transport runs: every Transport here is one the library was built
    with (kernel_limits() checks the codes)."""
    if route.memory is not shape.memory:
        return f"a route of {route.memory.value} memory; this workspace is in {shape.memory.value} memory"
    if route.variant is Variant.ISLAND and shape.num_islands < 2:
        return "ISLAND needs a workspace with islands"
    if route.variant is Variant.ONESHOT and nbytes > shape.oneshot_max_bytes:
        return f"one-shot takes at most {shape.oneshot_max_bytes} B in this workspace, the call has {nbytes} B"
    if fused and route.threads is not None:
        return "threads: the fused kernels size their own CTAs"
    if not fused and route.cluster is not None:
        return "cluster: a plain call has no rows to spread"
    if route.cluster is not None and route.cluster > 1 and route.cluster not in shape.clusters:
        launched = "/".join(map(str, shape.clusters)) or "none"
        return f"clusters of {route.cluster} CTAs are not launched by this workspace (its clusters: {launched})"
    if route.ctas is not None and route.ctas > shape.sm_budget:
        return f"{route.ctas} CTAs: this workspace launches at most {shape.sm_budget}"
    if route.threads is not None and route.threads > limits.plain_max_threads:
        return f"{route.threads} threads: the plain kernels take at most {limits.plain_max_threads}"
    if route.window is not None and route.window > shape.world_size - 1:
        return f"a window of {route.window} passes: {shape.world_size} ranks make {shape.world_size - 1}"
    return None


def cta_cap(route: Route, shape: WorkspaceShape) -> int:
    """The CTA cap `route` launches with on the workspace of `shape`: its own, else the seed cap."""
    return route.ctas if route.ctas is not None else shape.sm_budget


def plain_threads(nbytes: int, transport: Transport | str = SEED_TRANSPORT, *, ctas: int | None = None,
                  limits: KernelLimits | None = None) -> int:
    """The plain kernels' seed CTA size for a message of `nbytes` bytes over `transport`; with a CTA cap `ctas` (and
    the library's `limits`) doubled until the call's CTAs fit the cap in one wave, up to the kernels' largest."""
    if nbytes > PLAIN_THREADS_SWITCH_BYTES:
        threads = PLAIN_THREADS_LARGE
    elif _as_enum(Transport, transport) is Transport.STAGED:
        threads = PLAIN_THREADS_STAGED_SMALL
    else:
        threads = PLAIN_THREADS_TINY if nbytes <= PLAIN_THREADS_TINY_BYTES else PLAIN_THREADS_SMALL
    if ctas is not None and limits is not None and ctas > 0:
        packs = max(1, nbytes // limits.pack_bytes)
        while threads * 2 <= limits.plain_max_threads and -(-packs // threads) > ctas:
            threads *= 2
    return threads


def plain_grid(nbytes: int, ctas: int, threads: int, limits: KernelLimits) -> int:
    """The CTAs a plain call of `nbytes` launches under a cap of `ctas` with `threads` per CTA (launch_plain in
    csrc/ar_kernels.cu: one CTA per `threads` packs, a CTA no wider than the packs rounded up to a warp)."""
    packs = max(1, nbytes // limits.pack_bytes)
    threads = min(threads, limits.plain_max_threads, -(-packs // THREAD_GRAIN) * THREAD_GRAIN)
    return max(1, min(-(-packs // threads), ctas))


def fused_grid(rows: int, ctas: int, cluster: int) -> int:
    """The CTAs a fused one-shot call of `rows` rows launches under a cap of `ctas`: one CTA per row, or one
    cluster of `cluster` CTAs per row, as many as fit at once (launch_cluster_kernel / launch_grouped)."""
    if cluster > 1:
        return max(1, min(rows, ctas // cluster)) * cluster
    return max(1, min(rows, ctas))


# ---------------------------------------------------------------------------------------------------------
# The seeds


def choose_variant(nbytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> Variant:
    """The seed variant of a message of `nbytes` bytes.

    world_size <= 2: one-shot always (two-shot moves the same bytes in twice the hops).
    NVLink: one-shot up to NVLINK_ONESHOT_MAX_BYTES, then flat two-shot.
    PCIe: one-shot up to PCIE_ONESHOT_MAX_BYTES[world], then the island schedule when the topology gave
    two or more islands, else flat two-shot.
    Host memory: one-shot up to HOST_ONESHOT_MAX_BYTES[world], then flat two-shot (no islands).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    link = _as_enum(Link, link)
    if nbytes <= oneshot_max_bytes(world_size, link):
        return Variant.ONESHOT
    if link is Link.PCIE and num_islands >= 2:
        return Variant.ISLAND
    return Variant.TWOSHOT


def oneshot_max_bytes(world_size: int, link: Link | str) -> int:
    """The largest message the seeds send one-shot (without islands): a host-memory workspace sizes its one-shot
    slots by it (csrc/workspace.cu), the case that saves (at 4 and 8 ranks)."""
    link = _as_enum(Link, link)
    if world_size <= 2:
        return 1 << 62
    if link is Link.HOST:
        return HOST_ONESHOT_MAX_BYTES.get(world_size, HOST_ONESHOT_MAX_BYTES[8])
    if link is Link.NVLINK:
        return NVLINK_ONESHOT_MAX_BYTES
    return PCIE_ONESHOT_MAX_BYTES.get(world_size, PCIE_ONESHOT_MAX_BYTES[8])


def oneshot_max_numel(world_size: int, memory: Memory | str, max_numel: int, limits: KernelLimits) -> int:
    """The elements a workspace's one-shot slots hold (csrc/workspace.cu sizes them by it): the whole bound in
    device memory; in host memory the seeds' one-shot range only, which at 4 and 8 ranks saves most of the shared
    buffer (8 ranks at the 458,752 B bound: ~16 MiB of /dev/shm, not 56 MiB)."""
    if _as_enum(Memory, memory) is Memory.DEVICE:
        return max_numel
    grain = limits.elems_per_pack
    limit = oneshot_max_bytes(world_size, Link.HOST) // ELEMENT_BYTES // grain * grain
    return max(grain, min(max_numel, limit))


def seed_route(nbytes: int, shape: WorkspaceShape, transport: Transport | str = SEED_TRANSPORT) -> Route:
    """The route of a message of `nbytes` bytes before anything was measured: the seed variant over `transport`,
    every launch field by its seed rule (module docstring of Route)."""
    return Route(choose_variant(nbytes, shape.world_size, shape.link, shape.num_islands), transport, shape.memory)


def schedule(max_bytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> list[tuple[int, int, Variant]]:
    """The seed variant of every message size from 1 to `max_bytes` bytes, as (first byte count, last, variant)
    ranges: what a log line or the doctor says about a workspace. Each variant serves one contiguous range."""
    ranges: list[tuple[int, int, Variant]] = []
    low = 1
    while low <= max_bytes:
        variant = choose_variant(low, world_size, link, num_islands)
        lo, hi = low, max_bytes
        while lo < hi:  # the largest size still served by `variant`
            mid = (lo + hi + 1) // 2
            if choose_variant(mid, world_size, link, num_islands) is variant:
                lo = mid
            else:
                hi = mid - 1
        ranges.append((low, lo, variant))
        low = lo + 1
    return ranges


def describe_schedule(max_bytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> str:
    """'ONESHOT up to 16384 B, ISLAND up to 458752 B' for the given workspace."""
    return ", ".join(
        f"{variant.name} up to {high} B" for _, high, variant in schedule(max_bytes, world_size, link, num_islands)
    )


def resolve(route: Route, nbytes: int, shape: WorkspaceShape, limits: KernelLimits, *, fused: bool) -> Route:
    """`route` with the launch fields it left None filled by their seed rules (interim)."""
    ctas = cta_cap(route, shape)
    threads = None if fused else (route.threads or plain_threads(nbytes, route.transport, ctas=ctas, limits=limits))
    return dataclasses.replace(route, ctas=ctas, threads=threads)
