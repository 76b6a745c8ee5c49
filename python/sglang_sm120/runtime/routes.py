"""What one TP group's backend routes where: a tuned table of this box, or the seeds.

`RouteBook.call(nbytes, dtype, fused)` is the dispatch rule's second half (the first: the byte bound and the
workspace's `supports()`): None sends the call to NCCL (SGLang's own path), else the keyword arguments of the
kernel call. It is a pure function of the size, the dtype and what was agreed at build (the table's digest, the
workspace's memory and islands), so every rank routes every call the same way.

- A table route of ours is served only if this workspace can run it: its memory, islands for ISLAND, a
  transport this build offers. Anything else goes to NCCL: the table is never stretched to a size or a
  configuration it did not measure (a size past its largest measured one is NCCL too).
- The seeds route every size within the bound to our kernels, with the kernels' own variant choice
  (sgl_kernel_sm120/variants.py): the behaviour before tables existed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..routing.table import Route, RoutingTable, describe, lookup
from ..tuning.candidates import KernelOffer, call_kwargs

TUNE_COMMAND = "python -m sglang_sm120.tune"
TABLE, SEEDS = "table", "seeds"


@dataclasses.dataclass
class RouteBook:
    source: str  # TABLE | SEEDS
    table: RoutingTable | None = None
    path: str = ""
    why: str = ""  # seeds: why no table routes this group
    memory: str | None = None
    num_islands: int = 1
    offer: KernelOffer = dataclasses.field(default_factory=KernelOffer)
    _memo: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def seeds(cls, why: str = "") -> RouteBook:
        return cls(SEEDS, why=why)

    def _servable(self, route: Route | None) -> tuple[Route, dict[str, Any]] | None:
        if route is None or not route.ours or route.memory != self.memory:
            return None
        if route.variant == "ISLAND" and self.num_islands < 2:
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
        if self.source == SEEDS:
            found: tuple[Route | None, dict[str, Any]] | None = (None, {})
        else:
            found = self._servable(lookup(self.table, nbytes, dtype, fused))
        self._memo[key] = found
        return found

    def source_line(self) -> str:
        """What the activation line says about where the routes come from."""
        if self.source == TABLE:
            return f"routes: tuned table {self.path}, measured {self.table.measured}"
        return f"routes: seeds, not measured on this box ({TUNE_COMMAND})"

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
        else:
            out["why"] = self.why
        return out
