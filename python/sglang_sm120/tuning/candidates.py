"""Which of our kernels' configurations the tuner times at a size, and how a route becomes a kernel call.

`candidates()` is a pure function of group-identical inputs (the agreed `GroupShape` and `KernelOffer`, the
size, the kind), so every rank times the same candidates in the same order; a rank that timed another list
would wait in a collective its peers never enter. The rules:
- ONESHOT always (host memory: up to the workspace's one-shot bound); TWOSHOT from 4 ranks on (at 2 it moves the
  same bytes as one-shot in twice the hops); ISLAND when the workspace has two or more islands (device memory);
- device memory: every transport the installed kernels offer; the others are listed as skipped, "not available
  in this build"; host memory: push only (every byte goes through the shared host buffer);
- the fused one-shot: the kernel's own CTA-per-row rule in quick mode; one CTA per row and every agreed cluster
  size in a full tune;
- NCCL is not a candidate of ours: the tuner always times it, as the incumbent.

`detect_offer()` reads what the installed kernel package offers without assuming it: the transports of
`sgl_kernel_sm120.variants.Transport` (push only while that enum does not exist), and whether `IpcAllReduce` and
its two ops take `transport=` / `cluster=` (signature checks). This is the one place the overlay names
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

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "transports": list(self.transports)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> KernelOffer:
        return cls(tuple(raw.get("transports") or ("push",)), bool(raw.get("call_transport")),
                   bool(raw.get("ctor_transport")), bool(raw.get("call_cluster")))


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
    )


def agree_offer(offers: Iterable[KernelOffer]) -> KernelOffer:
    """What every rank offers (the same install on one box, but a rank must never be asked for more)."""
    offers = list(offers)
    common = [t for t in TRANSPORTS if all(t in o.transports for o in offers)]
    return KernelOffer(tuple(common) or ("push",), all(o.call_transport for o in offers),
                       all(o.ctor_transport for o in offers), all(o.call_cluster for o in offers))


@dataclasses.dataclass(frozen=True)
class GroupShape:
    """What the candidates depend on, agreed across the group."""

    world_size: int
    memory: str  # the workspace memory measured: "device" | "host"
    num_islands: int = 1
    oneshot_max_bytes: int = 1 << 62  # host memory at 4 and 8 ranks bounds its one-shot slots
    clusters: tuple[int, ...] = ()  # cluster sizes the fused one-shot may launch (agreed by the workspace)


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
            clusters: list[int | None] = [None]
            if kind == "fused" and variant == "ONESHOT" and not quick:
                clusters = [1] + [c for c in CLUSTERS if c > 1 and c in shape.clusters]
            for cluster in clusters:
                routes.append(Route(OURS, variant, transport, shape.memory, cluster))
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
    return kwargs


def apply_cluster(workspace, route: Route, offer: KernelOffer, kwargs: dict[str, Any]) -> dict[str, Any]:
    """For a fused call: the cluster of `route` as a call argument where the kernels take one, else set on the
    workspace (read at call time; the same value on every rank, as every argument). Returns the kwargs."""
    cluster = route.cluster
    if offer.call_cluster:
        return {**kwargs, "cluster": cluster}
    workspace.fused_cluster = cluster
    return kwargs
