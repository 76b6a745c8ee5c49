"""What one TP group's backend routes where: a tuned table of this box, the seeds, or NCCL for every size.

`RouteBook.route(nbytes, dtype, fused)` is the dispatch decision once the call's tensor is one the workspace takes
(`IpcAllReduce.supports`): None sends the call to NCCL (SGLang's own path), else the route of ours to launch. It is
a pure function of the size, the dtype and what was agreed at build (the table, the workspace's shape and its
library's limits), so every rank routes every call the same way; each size is decided once and remembered.

- A table route is served only where the workspace can run it as it was measured (sgl_kernel_sm120.policy.refusal:
  its memory, islands for ISLAND, a cluster size the workspace launches, a CTA cap within its budget). Anything
  else goes to NCCL, never to another launch nobody measured; a size past the table's largest measured one is NCCL
  too. The table handed in was re-derived without the candidates blamed on this box (routing/table.py), so none
  of those is routed either.
- NCCL for every size (`all_nccl`): what any failure to find or make a usable table ends in. The backend stays
  attached (its counters and `/get_server_info` say why), and SGLang's own path serves every call.
- The seeds route every size to our kernels with sgl_kernel_sm120.policy.seed_route, unmeasured: only when the
  user asks for them (--sm120-allreduce-tune off).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sgl_kernel_sm120.policy import KernelLimits, Route, WorkspaceShape, refusal, seed_route

from .table import RoutingTable, describe, lookup

TUNE_COMMAND = "python -m sglang_sm120.tune"
RETRY = f"--sm120-allreduce-tune force, or {TUNE_COMMAND}"
TABLE, SEEDS, ALL_NCCL = "table", "seeds", "nccl"


@dataclasses.dataclass
class RouteBook:
    source: str  # TABLE | SEEDS | ALL_NCCL
    table: RoutingTable | None = None
    path: str = ""
    why: str = ""  # seeds and all NCCL: why no table routes this group
    shape: WorkspaceShape | None = None  # what the workspace runs (TABLE and SEEDS)
    limits: KernelLimits | None = None  # its library's limits (TABLE and SEEDS)
    blamed: tuple[Mapping[str, Any], ...] = ()  # candidates a crash or hang on this box was blamed on
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.source not in (TABLE, SEEDS, ALL_NCCL):
            raise ValueError(f"unknown route source {self.source!r}")
        if self.source != ALL_NCCL and (self.shape is None or self.limits is None):
            raise ValueError(f"routes from {self.source} need the workspace's shape and its library's limits")
        if self.source == TABLE and self.table is None:
            raise ValueError("routes from a table need the table")

    @classmethod
    def seeds(cls, shape: WorkspaceShape, limits: KernelLimits, why: str = "") -> RouteBook:
        return cls(SEEDS, why=why, shape=shape, limits=limits)

    @classmethod
    def all_nccl(cls, why: str) -> RouteBook:
        return cls(ALL_NCCL, why=why)

    def route(self, nbytes: int, dtype: str, fused: bool) -> Route | None:
        """The route of ours for a call of `nbytes` bytes of `dtype`; None: NCCL."""
        key = (nbytes, dtype, fused)
        try:
            return self._memo[key]
        except KeyError:
            pass
        found: Route | None = None
        if self.source == SEEDS:
            found = seed_route(nbytes, self.shape)
        elif self.source == TABLE:
            found = lookup(self.table, nbytes, dtype, fused)
        if found is not None and refusal(self.shape, found, nbytes, fused=fused, limits=self.limits) is not None:
            found = None
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
