"""What one TP group's backend routes where: its tuned table (re-derived without the candidates blamed on this box),
the seeds (unmeasured; only when the user asks: tune off), or NCCL for every size (what any failure to find a usable
table ends in; the backend stays attached, its counters say why).

`RouteBook.route` is a pure function of the size, the dtype and what was agreed at build, so every rank routes every
call alike. A table route serves only where the workspace runs it as measured (sgl_kernel_sm120.policy.refusal);
else NCCL, never a launch nobody measured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sgl_kernel_sm120.policy import KernelLimits, Route, WorkspaceShape, refusal, resolve, seed_route

from .table import RoutingTable, describe, lookup

TUNE_COMMAND = "python -m sglang_sm120.tune"
TABLE, SEEDS, ALL_NCCL = "table", "seeds", "nccl"


@dataclasses.dataclass
class RouteBook:
    source: str  # TABLE | SEEDS | ALL_NCCL
    table: RoutingTable | None = None
    path: str = ""
    why: str = ""  # seeds and all NCCL: why no table routes this group
    shape: WorkspaceShape | None = None
    limits: KernelLimits | None = None
    blamed: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self):
        if self.source != ALL_NCCL and (self.shape is None or self.limits is None):
            raise ValueError(f"routes from {self.source} need the workspace's shape and its library's limits")

    def route(self, nbytes: int, dtype: str, fused: bool) -> Route | None:
        """The resolved route of ours for a call of `nbytes` bytes of `dtype`; None: NCCL. Callers memoize."""
        if self.source == ALL_NCCL:
            return None
        found = seed_route(nbytes, self.shape) if self.source == SEEDS else lookup(self.table, nbytes, dtype, fused)
        if found is None or refusal(self.shape, found, nbytes, fused=fused, limits=self.limits) is not None:
            return None
        return resolve(found, nbytes, self.shape, self.limits, fused=fused)

    def source_line(self) -> str:
        if self.source == TABLE:
            return f"routes: tuned table {self.path}, measured {self.table.measured}"
        if self.source == SEEDS:
            return ("routes: seeds, UNMEASURED on this box: every size within the bound goes to the sm120 kernels "
                    f"(--sm120-allreduce-tune off; {TUNE_COMMAND} measures this box)")
        return f"routes: all NCCL because {self.why} (tune: {TUNE_COMMAND})"

    def describe(self, dtype: str, max_bytes: int) -> str:
        """'plain: ONESHOT/push/device up to 43008 B, NCCL up to 1835008 B; fused: ...' (a table only)."""
        if self.source != TABLE:
            return ""
        return "; ".join(f"{kind}: {describe(self.table, dtype, kind, up_to=max_bytes)}" for kind in ("plain", "fused"))

    def as_dict(self, dtype: str | None, max_bytes: int) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "line": self.source_line()}
        if self.source != TABLE:
            routes = "all sizes: NCCL" if self.source == ALL_NCCL else "all sizes within the bound: seeds"
            return {**out, "why": self.why, "routes": routes}
        out.update(path=self.path, measured=self.table.measured, quick=self.table.quick,
                   routes=self.describe(dtype, max_bytes) if dtype else "")
        return {**out, "blamed": [dict(b) for b in self.blamed]} if self.blamed else out
