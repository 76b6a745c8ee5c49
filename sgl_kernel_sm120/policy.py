"""The dispatch policy as data: one launch (`Route`), what a built workspace runs as a route says (`refusal`), the
routes before anything was measured (`seed_route`), a route with its launch fields filled (`resolve`), and every
threshold. Standard library only (the overlay imports it without torch); the kernels' own limits and enum codes
are read from the loaded library (`kernel_limits()`), never copied. Every function is pure in group-identical
inputs, so every rank answers the same: a rank launching another route than its peers would wait forever. The
seeds are the tuner's starting points, not measurements of a PCIe SM120 box (docs/design.md).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
from collections.abc import Mapping
from typing import Any


class Schedule(enum.IntEnum):
    """The schedule of a call (codes: csrc/ar_launch.h enum class Schedule)."""

    ONESHOT = 0  # every rank pushes everything to everyone and reduces locally: one hop, (W-1)x bytes
    TWOSHOT = 1  # flat reduce-scatter to owners, then all-gather: two hops, ~2x bytes
    ISLAND = 2  # reduce-scatter inside each island, fp32 exchange between twins, all-gather: three hops


class _Coded(str, enum.Enum):
    @property
    def code(self) -> int:
        """The C++ enum's value: the member's position (parse_kernel_limits holds it to the library's)."""
        return list(type(self)).index(self)


class Transport(_Coded):
    """How a call's data travels (csrc/transports/; codes: csrc/ar_types.h enum Transport)."""

    PUSH = "push"  # every rank stores into every peer's scratch at once
    STAGED = "staged"  # the same stores in W-1 permutation passes, one destination per pass
    PULL = "pull"  # every rank stores into its own slab and the peers load from it; readiness by flags


class Memory(_Coded):
    """Where the scratch lives (codes: csrc/ar_launch.h enum class Memory)."""

    DEVICE = "device"  # each rank's slab in its GPU, reached by the peers over CUDA IPC
    HOST = "host"  # every rank's slab in one pinned shared host buffer mapped into every GPU (no P2P)


class Link(str, enum.Enum):
    """What joins the GPUs: a hint for the seed schedules only (a wrong one costs speed, never correctness)."""

    NVLINK = "nvlink"
    PCIE = "pcie"
    HOST = "host"  # no P2P: every byte goes through pinned host memory (Memory.HOST)


WORLD_SIZES = (1, 2, 4, 8)  # csrc/ar_types.h kWorldSizes (1: a no-op)
DTYPES = ("bfloat16", "float16")  # torch's names of the element types the kernels take
ELEMENT_BYTES = 2  # both of them
CLUSTER_SIZES = (2, 4, 8)  # csrc/ar_types.h kClusterSizes: the fused one-shot's cluster kernel
ROW_SPLITS = (1, *CLUSTER_SIZES)  # CTAs per row of the fused one-shot (1: the one-CTA kernel, the same bits)
THREAD_GRAIN = 32  # a CTA is whole warps
UNBOUNDED = 1 << 62  # a byte bound that is never reached

# Seeds. Push everywhere until the tuner measures another transport on the box; staged push on the whole SM budget
# too (every pass in flight); the tuner also times it on this few-CTA cap, for fabrics where pacing pays.
SEED_TRANSPORT = Transport.PUSH
STAGED_FEW_CTAS = 8
# One-shot bounds. 2 ranks: one-shot always (two-shot moves the same bytes in twice the hops). NVLink: from
# one-shot's (W-1)x traffic. PCIe: posted all-to-all writes collapse past a few tens of KB. Host memory: every byte
# crosses PCIe three times (push, poll, the emptying store) and one-shot reads W-1 payloads, two-shot ~2; a
# host-memory workspace sizes its one-shot slots by this bound.
NVLINK_ONESHOT_MAX_BYTES = 512 * 1024
PCIE_ONESHOT_MAX_BYTES = {2: UNBOUNDED, 4: 32 * 1024, 8: 16 * 1024}
HOST_ONESHOT_MAX_BYTES = {2: UNBOUNDED, 4: 16 * 1024, 8: 8 * 1024}
# The plain kernels' CTA size: small CTAs while latency dominates, larger ones for bandwidth (staged push: its
# sweeps ran 256 threads); under a CTA cap too small for one wave the size doubles until the call fits.
PLAIN_THREADS_TINY, PLAIN_THREADS_SMALL, PLAIN_THREADS_LARGE = 64, 128, 512
PLAIN_THREADS_STAGED_SMALL = 256
PLAIN_THREADS_TINY_BYTES = 64 * 1024
PLAIN_THREADS_SWITCH_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class KernelLimits:
    """What the loaded library's kernels take (csrc/ar_launch.h, csrc/ar_types.h)."""

    plain_max_threads: int  # kPlainMaxThreads
    max_packs_per_thread: int  # kMaxPacksPerThread
    max_fused_hidden: int  # kMaxFusedHidden
    max_world: int  # kMaxWorld
    max_ctas: int  # kMaxCounters: the largest grid, and SM count, a workspace keeps counters for
    pack_bytes: int  # kPackBytes: one vector store
    elems_per_pack: int  # kElemsPerPack: a tensor's size and a row's width are multiples of it
    owner_block_packs: int  # kOwnerBlockPacks: the staged schedules' hand-over unit

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def parse_kernel_limits(text: str) -> KernelLimits:
    """The library's `kernel_limits()` JSON; ValueError when a limit is missing or an enum code is not this
    module's (the library was built from other sources)."""
    raw = json.loads(text)
    if not isinstance(raw, Mapping) or not all(isinstance(v, int) for v in raw.values()):
        raise ValueError(f"kernel_limits() must be a JSON object of integers, got {text!r}")
    ours = {f"schedule_{s.name.lower()}": int(s) for s in Schedule}
    ours.update({f"{kind.__name__.lower()}_{m.value}": m.code for kind in (Transport, Memory) for m in kind})
    if differing := ", ".join(f"{name} is {raw.get(name)} there, {code} here"
                              for name, code in sorted(ours.items()) if raw.get(name) != code):
        raise ValueError(f"the kernel library's enum codes differ from sgl_kernel_sm120.policy's ({differing}): "
                         "rebuild the library from this checkout")
    fields = [f.name for f in dataclasses.fields(KernelLimits)]
    if missing := [name for name in fields if name not in raw]:
        raise ValueError(f"kernel_limits() lacks {missing}: rebuild the library from this checkout")
    return KernelLimits(**{name: int(raw[name]) for name in fields})


@functools.lru_cache(maxsize=1)
def kernel_limits() -> KernelLimits:
    """The limits of the library this process loads (loads it; KernelsNotBuiltError when it cannot)."""
    from . import _ext

    return parse_kernel_limits(str(_ext.ops().kernel_limits()))


def _as_enum(kind: type[enum.Enum], value: Any) -> Any:
    if isinstance(value, kind):
        return value
    try:
        return kind[value] if kind is Schedule and isinstance(value, str) else kind(value)
    except (KeyError, ValueError):
        allowed = ", ".join(m.name if kind is Schedule else m.value for m in kind)
        raise ValueError(f"unknown {kind.__name__.lower()} {value!r} (known: {allowed})") from None


# The launch fields of a route id after schedule/transport/memory, each /<letter><number>, in this order.
LAUNCH_FIELDS = (("ctas", "b"), ("cluster", "c"), ("threads", "t"), ("window", "w"))
_LAUNCH_TAIL = re.compile("".join(rf"(?:/{letter}(\d+))?" for _, letter in LAUNCH_FIELDS))


@dataclasses.dataclass(frozen=True)
class Route:
    """One launch of the kernels: every field that changes what runs. A launch field left None takes its seed rule
    on the workspace (`resolve`): `ctas` the SM budget, `threads` plain_threads(), `cluster` and `window` the
    kernels' own rule. A route that names them is exactly the launch that was measured."""

    schedule: Schedule
    transport: Transport = SEED_TRANSPORT
    memory: Memory = Memory.DEVICE
    ctas: int | None = None  # the CTA cap
    cluster: int | None = None  # fused one-shot: CTAs per row (ROW_SPLITS)
    threads: int | None = None  # plain kernels: threads per CTA
    window: int | None = None  # staged push: passes in flight before their pacing waits, 1 .. world - 1
    # (schedule, threads, ctas, cluster, transport, window) as the ops take them (0: the kernels' rule): derived once,
    # when the route is made, so a call's launch converts nothing.
    launch_args: tuple[int, int, int, int, int, int] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name, kind in (("schedule", Schedule), ("transport", Transport), ("memory", Memory)):
            object.__setattr__(self, name, _as_enum(kind, getattr(self, name)))
        for name, _ in LAUNCH_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} {value!r}: a positive number")
        if self.cluster is not None and (self.cluster not in ROW_SPLITS or self.schedule is not Schedule.ONESHOT):
            raise ValueError(f"cluster {self.cluster}: the fused one-shot spreads a row over {ROW_SPLITS} CTAs")
        if self.ctas is not None and self.cluster is not None and self.ctas < self.cluster:
            raise ValueError(f"ctas {self.ctas} cannot hold one cluster of {self.cluster} CTAs")
        if self.threads is not None and self.threads % THREAD_GRAIN:
            raise ValueError(f"threads {self.threads}: a CTA is whole warps of {THREAD_GRAIN}")
        if self.window is not None and self.transport is not Transport.STAGED:
            raise ValueError(f"window {self.window}: only staged push runs its passes in a window")
        object.__setattr__(self, "launch_args", (int(self.schedule), self.threads or 0, self.ctas or 0,
                                                 self.cluster or 0, self.transport.code, self.window or 0))

    @property
    def id(self) -> str:
        """'ONESHOT/push/device', then '/b94' (at most 94 CTAs), '/c8' (a row over an 8-CTA cluster), '/t256' (256
        threads per CTA), '/w2' (staged push with 2 passes in flight), for the fields that are set."""
        tail = "".join(f"/{letter}{getattr(self, name)}" for name, letter in LAUNCH_FIELDS
                       if getattr(self, name) is not None)
        return f"{self.schedule.name}/{self.transport.value}/{self.memory.value}{tail}"

    @classmethod
    def parse(cls, text: str) -> Route:
        """The route of an id (ValueError naming what is wrong)."""
        parts = str(text).split("/", 3)
        if len(parts) < 3:
            raise ValueError(f"bad route {text!r}: expected 'SCHEDULE/TRANSPORT/MEMORY[/bN][/cN][/tN][/wN]'")
        tail = _LAUNCH_TAIL.fullmatch("/" + parts[3] if len(parts) > 3 else "")
        if tail is None:
            raise ValueError(f"bad route {text!r}: the launch parts are /bN, /cN, /tN, /wN, each at most once, in "
                             "that order")
        launch = {name: int(number) for (name, _), number in zip(LAUNCH_FIELDS, tail.groups(), strict=True) if number}
        return cls(*parts[:3], **launch)


@dataclasses.dataclass(frozen=True)
class WorkspaceShape:
    """What a built workspace runs, agreed by its ranks (so the same on every rank)."""

    world_size: int
    memory: Memory
    link: Link
    num_islands: int = 1  # 2 or more: ISLAND runs
    oneshot_max_bytes: int = UNBOUNDED  # the one-shot slots' bound (host memory at 4 and 8 ranks: the seed bound)
    clusters: tuple[int, ...] = ()  # cluster sizes every rank launches (its cluster check passed everywhere)
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
    """Why the workspace of `shape` cannot run `route` on `nbytes` bytes as the route says, or None. A refused route
    goes to NCCL, never to another launch: the kernels would otherwise clamp or fall back to a launch nobody
    measured. Every Transport runs (kernel_limits() checked the codes)."""
    if route.memory is not shape.memory:
        return f"a route of {route.memory.value} memory; this workspace is in {shape.memory.value} memory"
    if route.schedule is Schedule.ISLAND and shape.num_islands < 2:
        return "ISLAND needs a workspace with islands"
    if route.schedule is Schedule.ONESHOT and nbytes > shape.oneshot_max_bytes:
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
    """The CTA cap `route` launches with on the workspace of `shape`: its own, else the whole SM budget."""
    return route.ctas if route.ctas is not None else shape.sm_budget


def resolve(route: Route, nbytes: int, shape: WorkspaceShape, limits: KernelLimits, fused: bool) -> Route:
    """`route` with the launch fields the ops need filled by their seed rules on this workspace: the CTA cap and,
    plain, the CTA size. `cluster` and `window` may stay None: the kernels' own rule. Pure, so the overlay resolves
    a route once and the launch passes its numbers on."""
    ctas = cta_cap(route, shape)
    threads = route.threads
    if not fused and threads is None:
        threads = plain_threads(nbytes, route.transport, ctas=ctas, limits=limits)
    return route if (ctas, threads) == (route.ctas, route.threads) else \
        dataclasses.replace(route, ctas=ctas, threads=threads)


def plain_threads(nbytes: int, transport: Transport | str = SEED_TRANSPORT, *, ctas: int | None = None,
                  limits: KernelLimits | None = None) -> int:
    """The plain kernels' seed CTA size for `nbytes` bytes over `transport`; with a CTA cap `ctas` (and the
    library's `limits`) doubled until the call's CTAs fit the cap in one wave, up to the kernels' largest."""
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
    """The CTAs a plain call of `nbytes` launches under a cap of `ctas` with `threads` per CTA (csrc/ar_launch.h
    plain_grid: one CTA per `threads` packs, a CTA no wider than the packs rounded up to a warp)."""
    packs = max(1, nbytes // limits.pack_bytes)
    threads = min(threads, limits.plain_max_threads, -(-packs // THREAD_GRAIN) * THREAD_GRAIN)
    return max(1, min(-(-packs // threads), ctas))


def fused_grid(rows: int, ctas: int, cluster: int) -> int:
    """The CTAs a fused one-shot call of `rows` rows launches under a cap of `ctas` (csrc/ar_launch.h): one CTA per
    row, or one cluster of `cluster` CTAs per row, as many as fit at once (where the group holds that many)."""
    per_row = max(cluster, 1)
    return max(1, min(rows, ctas // per_row)) * per_row


def choose_schedule(nbytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> Schedule:
    """The seed schedule of `nbytes` bytes: ONESHOT up to oneshot_max_bytes(), then ISLAND on PCIe with islands."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    link = _as_enum(Link, link)
    if nbytes <= oneshot_max_bytes(world_size, link):
        return Schedule.ONESHOT
    return Schedule.ISLAND if link is Link.PCIE and num_islands >= 2 else Schedule.TWOSHOT


def oneshot_max_bytes(world_size: int, link: Link | str) -> int:
    """The largest message the seeds send one-shot (without islands)."""
    link = _as_enum(Link, link)
    if world_size <= 2:
        return UNBOUNDED
    if link is Link.NVLINK:
        return NVLINK_ONESHOT_MAX_BYTES
    bounds = HOST_ONESHOT_MAX_BYTES if link is Link.HOST else PCIE_ONESHOT_MAX_BYTES
    return bounds.get(world_size, bounds[max(bounds)])


def oneshot_max_numel(world_size: int, memory: Memory | str, max_numel: int, limits: KernelLimits) -> int:
    """The elements a workspace's one-shot slots hold (csrc/workspace.cu sizes them by it): the whole bound in device
    memory; in host memory the seeds' one-shot range only, which at 4 and 8 ranks saves most of the shared buffer."""
    if _as_enum(Memory, memory) is Memory.DEVICE:
        return max_numel
    grain = limits.elems_per_pack
    limit = oneshot_max_bytes(world_size, Link.HOST) // ELEMENT_BYTES // grain * grain
    return max(grain, min(max_numel, limit))


def seed_route(nbytes: int, shape: WorkspaceShape, transport: Transport | str = SEED_TRANSPORT) -> Route:
    """The route of `nbytes` bytes before anything was measured: every launch field left to its seed rule."""
    return Route(choose_schedule(nbytes, shape.world_size, shape.link, shape.num_islands), transport, shape.memory)


def describe_schedule(max_bytes: int, world_size: int, link: Link | str, num_islands: int = 1) -> str:
    """The seed schedule of every size up to `max_bytes`: 'ONESHOT up to 16384 B, ISLAND up to 458752 B'."""
    bound = oneshot_max_bytes(world_size, link)
    parts = [f"ONESHOT up to {min(bound, max_bytes)} B"]
    if max_bytes > bound:
        parts.append(f"{choose_schedule(max_bytes, world_size, link, num_islands).name} up to {max_bytes} B")
    return ", ".join(parts)
