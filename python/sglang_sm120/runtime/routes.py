"""What one TP group's backend routes where: a tuned table of this box, the seeds, or NCCL for every size.

`RouteBook.call(nbytes, dtype, fused)` is the dispatch rule's second half (the first: the byte bound and the
workspace's `supports()`): None sends the call to NCCL (SGLang's own path), else the keyword arguments of the
kernel call. It is a pure function of the size, the dtype and what was agreed at build (the table's digest, the
workspace's memory, islands and cluster sizes, the blamed candidates), so every rank routes every call the same
way.

- A table route of ours is served only if this workspace can run it as it was measured: its memory, islands for
  ISLAND, a cluster size the workspace launches, a transport this build offers, and no crash or hang blamed on
  it on this box. Anything else goes to NCCL, never to another launch nobody measured; a size past the table's
  largest measured one is NCCL too.
- NCCL for every size (`all_nccl`): what any failure to find or make a usable table ends in. The backend stays
  attached (its counters and `/get_server_info` say why), and SGLang's own path serves every call.
- The seeds route every size within the bound to our kernels, with the kernels' own variant choice
  (sgl_kernel_sm120/variants.py), unmeasured: only when the user asks for them (--sm120-allreduce-tune off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..routing.table import Route, RoutingTable, describe, lookup
from ..tuning.candidates import KernelOffer, call_kwargs

TUNE_COMMAND = "python -m sglang_sm120.tune"
RETRY = f"--sm120-allreduce-tune force, or {TUNE_COMMAND}"
TABLE, SEEDS, ALL_NCCL = "table", "seeds", "nccl"


def is_blamed(blamed: Sequence[Mapping[str, Any]], route_id: str, dtype: str, kind: str, nbytes: int) -> bool:
    """Whether a crash or hang on this box was blamed on `route_id` at this size (routing/cache.py blames)."""
    return any(b.get("candidate") == route_id and b.get("dtype") == dtype and b.get("kind") == kind
               and nbytes >= int(b.get("from_bytes", 0)) for b in blamed)


@dataclasses.dataclass
class RouteBook:
    source: str  # TABLE | SEEDS | ALL_NCCL
    table: RoutingTable | None = None
    path: str = ""
    why: str = ""  # seeds and all NCCL: why no table routes this group
    memory: str | None = None
    num_islands: int = 1
    offer: KernelOffer = dataclasses.field(default_factory=KernelOffer)
    clusters: tuple[int, ...] = ()  # cluster sizes (> 1) the workspace launches, agreed by its ranks
    blamed: tuple[Mapping[str, Any], ...] = ()  # candidates a crash or hang on this box was blamed on
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def seeds(cls, why: str = "") -> RouteBook:
        return cls(SEEDS, why=why)

    @classmethod
    def all_nccl(cls, why: str) -> RouteBook:
        return cls(ALL_NCCL, why=why)

    def _servable(self, route: Route | None, nbytes: int, dtype: str, kind: str):
        if route is None or not route.ours or route.memory != self.memory:
            return None
        if route.variant == "ISLAND" and self.num_islands < 2:
            return None
        if route.cluster is not None and route.cluster > 1 and route.cluster not in self.clusters:
            return None  # the kernel would fall back to a launch nobody measured
        if is_blamed(self.blamed, route.id, dtype, kind, nbytes):
            return None
        try:
            return route, call_kwargs(route, self.offer)
        except ValueError:
            return None

    def call(self, nbytes: int, dtype: str, fused: bool) -> tuple[Route | None, dict[str, Any]] | None:
        """None: NCCL. Else (the table's route, or None for the seeds; the kernel call's keyword arguments)."""
        key = (nbytes, dtype, fused)
        if key in self._memo:
            return self._memo[key]
        found: tuple[Route | None, dict[str, Any]] | None = None
        if self.source == SEEDS:
            found = (None, {})
        elif self.source == TABLE:
            kind = "fused" if fused else "plain"
            found = self._servable(lookup(self.table, nbytes, dtype, fused), nbytes, dtype, kind)
        self._memo[key] = found
        return found

    def source_line(self) -> str:
        """What the activation line says about where the routes come from."""
        if self.source == TABLE:
            return f"routes: tuned table {self.path}, measured {self.table.measured}"
        if self.source == SEEDS:
            return ("routes: seeds, UNMEASURED on this box: every size within the bound goes to the sm120 kernels "
                    f"(--sm120-allreduce-tune off; {TUNE_COMMAND} measures this box)")
        return f"routes: all NCCL because {self.why} (retry: {RETRY})"

    def describe(self, dtype: str, max_bytes: int) -> str:
        """'plain: ONESHOT/push/device up to 43008 B, NCCL up to 1835008 B; fused: ...' (table only)."""
        if self.source != TABLE:
            return ""
        return "; ".join(f"{kind}: {describe(self.table, dtype, kind, up_to=max_bytes)}" for kind in ("plain", "fused"))

    def as_dict(self, dtype: str | None, max_bytes: int) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "line": self.source_line()}
        if self.source == TABLE:
            out.update(path=self.path, measured=self.table.measured, quick=self.table.quick,
                       routes=self.describe(dtype, max_bytes) if dtype else "")
            if self.blamed:
                out["blamed"] = [dict(b) for b in self.blamed]
        else:
            out["why"] = self.why
            out["routes"] = "all sizes: NCCL" if self.source == ALL_NCCL else "all sizes within the bound: seeds"
        return out
