"""Which of our kernels' configurations the tuner times at a size, and how a route becomes a kernel call.

`candidates()` is a pure function of group-identical inputs (the agreed `GroupShape` and `KernelOffer`, the
size, the kind), so every rank times the same candidates in the same order; a rank that timed another list
would wait in a collective its peers never enter. The rules:
- ONESHOT always (host memory: up to the workspace's one-shot bound); TWOSHOT from 4 ranks on (at 2 it moves the
  same bytes as one-shot in twice the hops); ISLAND when the workspace has two or more islands (device memory);
- device memory: every transport the installed kernels offer; the others are listed as skipped, "not available
  in this build"; host memory: push only (every byte goes through the shared host buffer);
- the launch shape of each, in the quick tune too (`launch_shapes`): a few CTA caps up to the group's SM budget
  (staged push: from its own cap STAGED_MAX_CTAS up to the budget), and for the fused one-shot every cluster size
  the workspace agreed (1 always; 2, 4, 8 where the cluster check passed) whose clusters all fit the CTAs at
  once (rows x cluster <= CTAs: past that rows loop and the split loses, csrc/ar_kernels.cu
  fused_cluster_size). Shapes that launch the same grid at this size are timed once: the kernels clamp the
  grid to the work (plain: one CTA per `threads` packs; fused: one CTA, or one cluster, per row), so at few rows
  most caps are the same launch, and the route keeps the largest cap of them (the kernels' own default);
- NCCL is not a candidate of ours: the tuner always times it, as the incumbent.

`detect_offer()` reads what the installed kernel package offers without assuming it: the transports of
`sgl_kernel_sm120.variants.Transport` (push only while that enum does not exist), and whether `IpcAllReduce` and
its two ops take `transport=` / `cluster=` / `blocks=` (signature checks). This is the one place the overlay names
transports besides the routing table's data model and the report.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from ..routing.table import CLUSTERS, OURS, TRANSPORTS, Route

NOT_IN_BUILD = "not available in this build"
MAX_FUSED_HIDDEN = 65536  # sgl_kernel_sm120.ipc_allreduce.MAX_FUSED_HIDDEN (kMaxFusedHidden in csrc/ar_launch.h)


@dataclasses.dataclass(frozen=True)
class KernelOffer:
    transports: tuple[str, ...] = ("push",)  # what the installed kernels can run
    call_transport: bool = False  # all_reduce / all_reduce_add_rmsnorm take transport=
    ctor_transport: bool = False  # IpcAllReduce(..., transport="auto") is accepted
    call_cluster: bool = False  # all_reduce_add_rmsnorm takes cluster= (else the workspace's fused_cluster)
    call_blocks: bool = False  # both ops take blocks= (the launch's CTA cap); else no CTA count is tuned

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "transports": list(self.transports)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KernelOffer:
        return cls(tuple(raw.get("transports") or ("push",)), bool(raw.get("call_transport")),
                   bool(raw.get("ctor_transport")), bool(raw.get("call_cluster")), bool(raw.get("call_blocks")))


def _takes(func, name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def detect_offer(ipc_class=None, transport_enum=None) -> KernelOffer:
    """What the installed kernel package offers (this rank's view; `agree_offer` combines the ranks')."""
    if ipc_class is None:
        from sgl_kernel_sm120.ipc_allreduce import IpcAllReduce as ipc_class
    if transport_enum is None:
        try:
            transport_enum = getattr(importlib.import_module("sgl_kernel_sm120.variants"), "Transport", None)
        except ImportError:
            transport_enum = None
    values = {str(getattr(t, "value", t)) for t in transport_enum} if transport_enum is not None else {"push"}
    call_transport = _takes(ipc_class.all_reduce, "transport") and _takes(ipc_class.all_reduce_add_rmsnorm,
                                                                          "transport")
    transports = tuple(t for t in TRANSPORTS if t in values and (t == "push" or call_transport))
    return KernelOffer(
        transports=transports or ("push",),
        call_transport=call_transport,
        ctor_transport=_takes(ipc_class.__init__, "transport"),
        call_cluster=_takes(ipc_class.all_reduce_add_rmsnorm, "cluster"),
        call_blocks=_takes(ipc_class.all_reduce, "blocks") and _takes(ipc_class.all_reduce_add_rmsnorm, "blocks"),
    )


def agree_offer(offers: Iterable[KernelOffer]) -> KernelOffer:
    """What every rank offers (the same install on one box, but a rank must never be asked for more)."""
    offers = list(offers)
    common = [t for t in TRANSPORTS if all(t in o.transports for o in offers)]
    return KernelOffer(tuple(common) or ("push",), all(o.call_transport for o in offers),
                       all(o.ctor_transport for o in offers), all(o.call_cluster for o in offers),
                       all(o.call_blocks for o in offers))


@dataclasses.dataclass(frozen=True)
class GroupShape:
    """What the candidates depend on, agreed across the group."""

    world_size: int
    memory: str  # the workspace memory measured: "device" | "host"
    num_islands: int = 1
    oneshot_max_bytes: int = 1 << 62  # host memory at 4 and 8 ranks bounds its one-shot slots
    clusters: tuple[int, ...] = ()  # cluster sizes the fused one-shot may launch (agreed by the workspace)
    sm_budget: int = 0  # CTAs a launch may use (the group's smallest SM count); 0: unknown, no CTA count tuned
    staged_ctas: int = 8  # staged push's own CTA cap (sgl_kernel_sm120.variants.STAGED_MAX_CTAS)


# The CTA caps tried, as fractions of the SM budget (the budget itself always; staged push from its own cap up).
QUICK_CTA_FRACTIONS = (2, 1)  # budget / 2, budget
FULL_CTA_FRACTIONS = (4, 2, 1)
PACK_BYTES = 16  # one 128-bit pack, the kernels' unit of work


def plain_grid(nbytes: int, ctas: int) -> int:
    """The CTAs a plain call of `nbytes` launches under a cap of `ctas` (launch_plain in csrc/ar_kernels.cu: one
    CTA per `threads` packs, threads from sgl_kernel_sm120.ipc_allreduce.plain_threads). Used only to time
    identical launches once: were it to drift from the kernels, two caps would be timed that need not be."""
    from sgl_kernel_sm120.ipc_allreduce import MAX_PLAIN_THREADS, plain_threads

    packs = max(1, nbytes // PACK_BYTES)
    threads = min(plain_threads(nbytes), MAX_PLAIN_THREADS, -(-packs // 32) * 32)
    return max(1, min(-(-packs // threads), ctas))


def fused_grid(rows: int, ctas: int, cluster: int) -> int:
    """The CTAs a fused call of `rows` rows launches under a cap of `ctas`: one CTA per row, or one cluster of
    `cluster` CTAs per row, as many as fit at once (launch_cluster_kernel / launch_grouped)."""
    if cluster > 1:
        return max(1, min(rows, ctas // cluster)) * cluster
    return max(1, min(rows, ctas))


def cta_caps(transport: str, shape: GroupShape, quick: bool) -> list[int]:
    """The CTA caps tried for `transport`, ascending; [] when the SM budget is unknown."""
    budget = int(shape.sm_budget)
    if budget < 1:
        return []
    caps = {max(1, budget // f) for f in (QUICK_CTA_FRACTIONS if quick else FULL_CTA_FRACTIONS)}
    if transport == "staged":
        cap = max(1, min(int(shape.staged_ctas), budget))
        caps = {cap, budget}
        if not quick:
            caps |= {c for c in (cap * 2, cap * 4, budget // 2) if cap < c < budget}
    return sorted(caps)


def launch_shapes(kind: str, variant: str, transport: str, nbytes: int, rows: int, shape: GroupShape,
                  offer: KernelOffer, quick: bool) -> list[tuple[int | None, int | None]]:
    """(CTA cap, cluster) of every launch of one variant and transport timed at this size, each a distinct grid.
    (None, None): the kernels' own shape, where this build takes no CTA count."""
    caps: list[int | None] = list(cta_caps(transport, shape, quick)) if offer.call_blocks else []
    fused_oneshot = kind == "fused" and variant == "ONESHOT"
    clusters: list[int | None] = [None]
    if fused_oneshot:
        clusters = [1] + [c for c in CLUSTERS if c > 1 and c in shape.clusters]
    if not caps:
        # No CTA count to choose: the budget is the cap (the grid an unknown budget allows is the kernels' call).
        budget = int(shape.sm_budget) or None
        return [(None, c) for c in clusters if c is None or c == 1 or budget is None or rows * c <= budget]
    chosen: dict[tuple[int, int], tuple[int, int | None]] = {}
    for cluster in clusters:
        for cap in caps:
            if cluster is not None and cluster > 1 and rows * cluster > cap:
                continue
            if kind == "plain":
                grid = plain_grid(nbytes, cap)
            else:
                grid = fused_grid(rows, cap, cluster or 1)
            chosen[(cluster or 1, grid)] = (cap, cluster)  # ascending caps: the largest of a grid stays
    return list(chosen.values())


def candidates(kind: str, nbytes: int, hidden: int, shape: GroupShape, offer: KernelOffer,
               quick: bool) -> tuple[list[Route], dict[str, str]]:
    """(our routes to time at this size, in a fixed order; {route id: why not} for the ones skipped)."""
    if kind not in ("plain", "fused"):
        raise ValueError(f"kind must be plain or fused, got {kind!r}")
    skipped: dict[str, str] = {}
    if nbytes <= 0 or nbytes % 16:
        return [], {}
    if kind == "fused" and (hidden % 8 or hidden > MAX_FUSED_HIDDEN or nbytes % (2 * hidden)):
        return [], {}
    rows = nbytes // (2 * hidden) if hidden > 0 else 0  # both dtypes the kernels take have 2-byte elements
    variants = ["ONESHOT"]
    if shape.world_size > 2:
        variants.append("TWOSHOT")
    if shape.num_islands >= 2 and shape.memory == "device":
        variants.append("ISLAND")
    if shape.memory == "host":
        transports = ["push"]
    else:
        transports = [t for t in TRANSPORTS if t in offer.transports]
        for transport in TRANSPORTS:
            if transport not in offer.transports:
                for variant in variants:
                    skipped[Route(OURS, variant, transport, shape.memory).id] = NOT_IN_BUILD
    routes: list[Route] = []
    for variant in variants:
        if variant == "ONESHOT" and nbytes > shape.oneshot_max_bytes:
            continue
        for transport in transports:
            for ctas, cluster in launch_shapes(kind, variant, transport, nbytes, rows, shape, offer, quick):
                routes.append(Route(OURS, variant, transport, shape.memory, cluster, ctas))
    return routes, skipped


def call_kwargs(route: Route, offer: KernelOffer) -> dict[str, Any]:
    """The keyword arguments of IpcAllReduce.all_reduce / all_reduce_add_rmsnorm that run `route` (the fused
    cluster goes separately, see `apply_cluster`). ValueError when this build cannot run it."""
    from sgl_kernel_sm120 import variants

    if not route.ours:
        raise ValueError("an NCCL route is not a kernel call")
    kwargs: dict[str, Any] = {"variant": variants.Variant[route.variant]}
    if route.transport not in offer.transports:
        raise ValueError(f"transport {route.transport!r}: {NOT_IN_BUILD}")
    if offer.call_transport:
        transport_enum = getattr(variants, "Transport", None)
        kwargs["transport"] = transport_enum(route.transport) if transport_enum is not None else route.transport
    if route.ctas is not None:
        if not offer.call_blocks:
            raise ValueError(f"a launch of {route.ctas} CTAs: {NOT_IN_BUILD}")
        kwargs["blocks"] = route.ctas
    return kwargs


def apply_cluster(workspace, route: Route, offer: KernelOffer, kwargs: dict[str, Any]) -> dict[str, Any]:
    """For a fused call: the cluster of `route` as a call argument where the kernels take one, else set on the
    workspace (read at call time; the same value on every rank, as every argument). Returns the kwargs."""
    cluster = route.cluster
    if offer.call_cluster:
        return {**kwargs, "cluster": cluster}
    workspace.fused_cluster = cluster
    return kwargs
