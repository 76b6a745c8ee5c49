"""The tune of one TP group, run on every rank in lockstep: verify -> time -> choose -> agree; the caller saves.

For each dtype, kind (plain, fused) and size (rows x hidden) of the spec, every candidate of
tuning/candidates.py and the incumbent NCCL are
1. verified: a few eager calls and then a burst of CUDA-graph replays (several calls in flight), every call
   with inputs of its own (tuning/calls.py), checked exact on every rank, the verdicts gathered and reduced
   (tuning/verify.py); a candidate failing anywhere fails everywhere;
2. timed: replays of that same graph, per replay the slowest rank, the median (tuning/timing.py), and the
   outputs of the last replay checked once more;
and `routing.table.choose` turns the gathered times into routes. Every collective step is a gather over the
group's CPU (gloo) group, so all ranks see the same lists and take the same branches. A candidate that fails
(wrong bits, an exception, a kernel wait that timed out: the workspaces are built with on_timeout="exit", so a
timeout poisons the workspace and returns instead of ending the CUDA context) is recorded with its reason, never
routed to, skipped at every larger size of that dtype and kind, and the workspaces are rebuilt before the next
candidate. A candidate that kills the process cannot be recorded here: the parent (tuning/launch.py) sees which
one was running, excludes it (`TuneSpec.exclude`) and starts again.

The GPU work sits behind the `Measurer` interface (tuning/measure.py has the CUDA one), so this module's
control flow runs on CPU in the tests with a fake measurer and threads as ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from sgl_kernel_sm120.policy import DTYPES, ELEMENT_BYTES, KernelLimits, Route, WorkspaceShape

from ..routing.table import NCCL, Point, RoutingTable, route_id
from . import candidates as cand
from .timing import aggregate_iteration_times, short_error
from .verify import reduce_verdicts

logger = logging.getLogger("sglang_sm120")

# Full tune: every row count up to 16 (the decode/verify sizes that matter most, and the two consecutive sizes the
# rule needs), then steps of about 25%; quick: the sizes below, each at most doubling.
FULL_DENSE_ROWS = 16
QUICK_ROWS = (1, 2, 3, 4, 6, 8)
# A candidate slower than PRUNE_FACTOR x NCCL at PRUNE_SIZES consecutive sizes is not timed at larger ones (NCCL
# gains on our kernels as sizes grow, so such a candidate does not come back), and once no candidate of ours is
# left, nothing is timed at the larger sizes of that dtype and kind: NCCL serves them. This keeps a full tune
# at TP=8 near its 20 s budget. Pruning compares with NCCL only, never with another candidate of ours: one
# that is slower than ONESHOT at a few rows may still win at many.
PRUNE_FACTOR = 1.5
PRUNE_SIZES = 2


class TuneError(RuntimeError):
    pass


def graph_rows(batch_sizes: Sequence[int], draft_tokens: int = 1) -> list[int]:
    """The row counts a server runs in CUDA graphs: every captured batch size times the draft tokens (target
    verify), and the batch sizes themselves (decode; the draft model's steps), ascending."""
    if draft_tokens < 1 or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes and draft tokens must be >= 1, got {list(batch_sizes)} x {draft_tokens}")
    return sorted({int(b) for b in batch_sizes} | {int(b) * int(draft_tokens) for b in batch_sizes})


def rows_ladder(max_rows: int, quick: bool, captured: Sequence[int] = ()) -> list[int]:
    """The row counts measured up to `max_rows` (which is always included), every row count of `captured` (the
    server's CUDA-graph shapes, `graph_rows`) up to `max_rows` among them: a captured shape is served by its own
    measurement, never by the next measured size's route (one above `max_rows` is past the byte bound: NCCL's)."""
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    if any(int(r) < 1 for r in captured):
        raise ValueError(f"captured row counts must be >= 1, got {sorted(captured)}")
    rows = {r for r in (QUICK_ROWS if quick else range(1, FULL_DENSE_ROWS + 1)) if r <= max_rows}
    rows |= {int(r) for r in captured if int(r) <= max_rows}
    step = 2.0 if quick else 1.25
    r = float(max(r for r in rows if r <= (QUICK_ROWS[-1] if quick else FULL_DENSE_ROWS)))
    while r < max_rows:
        r = max(r + 1, r * step)
        rows.add(min(int(r), max_rows))
    rows.add(max_rows)
    return sorted(rows)


@dataclasses.dataclass
class TuneSpec:
    hidden: int
    max_rows: int
    dtypes: list[str] = dataclasses.field(default_factory=lambda: ["bfloat16", "float16"])
    kinds: list[str] = dataclasses.field(default_factory=lambda: ["plain", "fused"])
    quick: bool = False
    calls: int = 20  # calls captured per graph
    iters: int = 20  # timed replays
    warmup: int = 5  # untimed replays
    verify_calls: int = 2  # eager calls checked per candidate (2: both halves of the double buffer)
    burst_replays: int = 2  # graph replays checked back to back, with new inputs each (tuning/measure.py)
    kernel_timeout_s: float = 5.0  # a kernel wait longer than this fails the candidate (on_timeout="exit")
    # Candidates the parent excluded after one killed the process: dtype, kind, candidate, from_bytes, reason.
    exclude: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Workspace set-up the runtime passes down (None: the child finds it out: P2P decides memory, NVML islands).
    memory: str | None = None
    islands: list[list[int]] | None = None
    islands_given: bool = False
    link: str | None = None
    # The row counts the server runs in CUDA graphs (tuner.graph_rows), each measured; () when not known.
    graph_rows: list[int] = dataclasses.field(default_factory=list)
    if_missing: bool = False  # stop when every rank finds a table of its key (the launcher's auto)
    # Debug, for a plumbing run where NCCL cannot start (ranks sharing one GPU): the incumbent's time is this
    # value instead of a measurement, and the table says so. Never set by the product.
    debug_nccl_us: float | None = None

    @property
    def rows(self) -> list[int]:
        return rows_ladder(self.max_rows, self.quick, self.graph_rows)

    @classmethod
    def make(cls, hidden: int, max_rows: int, *, quick: bool, **kwargs) -> TuneSpec:
        timing = {"calls": 10, "iters": 10, "warmup": 3} if quick else {}
        return cls(hidden=int(hidden), max_rows=int(max_rows), quick=quick, **{**timing, **kwargs})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TuneSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in fields})

    def excluded(self, dtype: str, kind: str, candidate: str, nbytes: int) -> str | None:
        for rule in self.exclude:
            if (rule.get("dtype"), rule.get("kind"), rule.get("candidate")) == (dtype, kind, candidate) and \
                    nbytes >= int(rule.get("from_bytes", 0)):
                return str(rule.get("reason", "excluded"))
        return None


class Measurer(Protocol):
    """The GPU side of one rank (tuning/measure.py). Every method that builds or frees a workspace is
    collective: the Tuner calls them on every rank at the same point. A route of None is NCCL."""

    def shape(self) -> WorkspaceShape:
        """What this rank's workspace runs; the Tuner agrees it across the ranks."""

    def limits(self) -> KernelLimits:
        """The limits of the kernel library this rank loads; the Tuner agrees them across the ranks."""

    def incumbent(self, kind: str) -> str:
        """What the NCCL route runs for `kind`, in words (e.g. 'NCCL + sgl_kernel.fused_add_rmsnorm')."""

    def verify(self, route: Route | None, kind: str, dtype: str, rows: int) -> str:
        """Run the candidate eagerly on the verify inputs, check it exact; the digest of the outputs. Raises on
        any failure (wrong values, a timed-out wait, an exception)."""

    def time(self, route: Route | None, kind: str, dtype: str, rows: int) -> list[float]:
        """This rank's us per call, one value per timed replay. Raises on failure."""

    def reset(self) -> None:
        """After a failed candidate: close the workspaces (collective); the next use builds them anew."""


class Tuner:
    def __init__(self, measurer: Measurer, spec: TuneSpec, *, rank: int, world: int,
                 gather: Callable[[Any], list], key: Mapping[str, Any],
                 progress: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.measurer, self.spec, self.rank, self.world = measurer, spec, rank, world
        self.gather, self.key = gather, dict(key)
        self.progress = progress or (lambda event: None)
        self.clock = clock
        self.notes: list[str] = []

    # ----------------------------------------------------------------------------------------------------
    def _agreed(self, local: Any) -> list:
        out = self.gather(local)
        if len(out) != self.world:
            raise TuneError(f"gather returned {len(out)} answers for {self.world} ranks")
        return out

    def _agree_setup(self) -> tuple[WorkspaceShape, KernelLimits]:
        views = self._agreed({"shape": self.measurer.shape().as_dict(), "limits": self.measurer.limits().as_dict()})
        for field, what in (("shape", "workspaces"), ("limits", "kernel libraries")):
            seen = [v[field] for v in views]
            if any(s != seen[0] for s in seen):
                raise TuneError(f"ranks see different {what}: {seen}")
        return WorkspaceShape.from_dict(views[0]["shape"]), KernelLimits(**views[0]["limits"])

    def _verify_and_time(self, route: Route | None, kind: str, dtype: str,
                         rows: int) -> tuple[float | None, str | None]:
        """(median us of the slowest rank, None) or (None, why it failed): the same on every rank."""
        if route is not None:
            local: tuple[str | None, str | None] = (None, None)
            try:
                local = (None, self.measurer.verify(route, kind, dtype, rows))
            except Exception as exc:  # noqa: BLE001 - recorded, agreed, never routed to
                local = (f"verify: {short_error(exc)}", None)
            verdict = reduce_verdicts(self._agreed(local))
            if verdict is not None:
                return None, verdict
        times, err = None, None
        try:
            if route is None and self.spec.debug_nccl_us is not None:
                times = [float(self.spec.debug_nccl_us)] * max(1, self.spec.iters)
            else:
                times = self.measurer.time(route, kind, dtype, rows)
        except Exception as exc:  # noqa: BLE001
            err = f"timing: {short_error(exc)}"
        gathered = self._agreed((times, err))
        errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
        if errors:
            return None, "; ".join(errors)
        try:
            return float(aggregate_iteration_times([g[0] for g in gathered])["median_us"]), None
        except ValueError as exc:
            return None, f"timing: {exc}"

    def _measure(self, dtype: str, kind: str, shape: WorkspaceShape, limits: KernelLimits) -> list[Point]:
        points: list[Point] = []
        sticky: dict[str, str] = {}  # candidate id -> why it is no longer tried at larger sizes
        losing: dict[str, int] = {}  # candidate id -> consecutive sizes it was slower than PRUNE_FACTOR x NCCL
        for rows in self.spec.rows:
            nbytes = rows * self.spec.hidden * ELEMENT_BYTES
            ours = cand.candidates(kind, nbytes, self.spec.hidden, shape, limits, self.spec.quick)
            times: dict[str, float] = {}
            failed: dict[str, str] = {}
            left = [r for r in ours
                    if not sticky.get(route_id(r)) and not self.spec.excluded(dtype, kind, route_id(r), nbytes)]
            if not left:
                for route in ours:
                    cid = route_id(route)
                    failed[cid] = sticky.get(cid) or self.spec.excluded(dtype, kind, cid, nbytes)
                if ours:
                    failed.setdefault(NCCL, "not timed: no candidate of ours left to compare with")
                points.append(Point(rows=rows, nbytes=nbytes, times=times, failed=failed))
                continue
            for route in [None, *ours]:
                cid = route_id(route)
                why = sticky.get(cid) or self.spec.excluded(dtype, kind, cid, nbytes)
                if why:
                    failed[cid] = why
                    continue
                self.progress({"event": "begin", "dtype": dtype, "kind": kind, "rows": rows, "bytes": nbytes,
                               "candidate": cid})
                us, why = self._verify_and_time(route, kind, dtype, rows)
                if us is not None:
                    times[cid] = us
                    continue
                failed[cid] = why
                sticky[cid] = f"failed at {nbytes} B: {why}"
                if route is not None:
                    self.measurer.reset()
                else:
                    self.notes.append(f"{dtype} {kind}: NCCL failed at {nbytes} B ({why}); no size from there on is "
                                      "routed to our kernels, for want of an NCCL time to beat")
            nccl = times.get(NCCL)
            for cid, us in times.items():
                if cid == NCCL or nccl is None:
                    continue
                losing[cid] = losing.get(cid, 0) + 1 if us > PRUNE_FACTOR * nccl else 0
                if losing[cid] >= PRUNE_SIZES:
                    sticky[cid] = (f"pruned: slower than {PRUNE_FACTOR:g}x NCCL at {PRUNE_SIZES} consecutive sizes "
                                   f"up to {nbytes} B")
            points.append(Point(rows=rows, nbytes=nbytes, times=times, failed=failed))
        return points

    def run(self) -> RoutingTable:
        start = self.clock()
        shape, limits = self._agree_setup()
        measurements: dict[tuple[str, str], list[Point]] = {}
        for dtype in self.spec.dtypes:
            if dtype not in DTYPES:
                raise TuneError(f"dtype {dtype!r} is not one the kernels take ({', '.join(DTYPES)})")
            for kind in self.spec.kinds:
                measurements[(dtype, kind)] = self._measure(dtype, kind, shape, limits)
        measure_s = self.clock() - start
        clocks = self._agreed((_utc_now(), measure_s))
        stamp, slowest = clocks[0][0], max(seconds for _, seconds in clocks)  # one clock for the table: rank 0's
        max_bytes = self.spec.max_rows * self.spec.hidden * ELEMENT_BYTES
        notes = list(self.notes)
        if self.spec.debug_nccl_us is not None:
            notes.append(f"DEBUG: NCCL was not measured; its time was set to {self.spec.debug_nccl_us} us "
                         "(plumbing run, these routes mean nothing)")
        table = RoutingTable.from_points(
            key=self.key,
            measured=stamp,
            workload={"hidden": self.spec.hidden, "rows": self.spec.rows, "dtypes": list(self.spec.dtypes),
                      "kinds": list(self.spec.kinds), "max_bytes": max_bytes, "workspace": shape.as_dict()},
            measurements=measurements,
            quick=self.spec.quick,
            durations={"measure": round(slowest, 3)},
            incumbents={kind: self.measurer.incumbent(kind) for kind in self.spec.kinds},
            notes=notes,
        )
        digests = self._agreed(table.digest())
        if any(d != digests[0] for d in digests):
            raise TuneError("the ranks built different tables from the same measurements")
        return table


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_points(points: Sequence[Point]) -> str:
    """For logs: 'rows 1: nccl 20.1, sm120/ONESHOT/push/device 9.8 us; ...'."""
    out = []
    for p in points:
        times = ", ".join(f"{cid} {us:.1f}" for cid, us in sorted(p.times.items(), key=lambda kv: kv[1]))
        out.append(f"rows {p.rows}: {times or 'nothing timed'} us")
    return "; ".join(out)


__all__ = ["Measurer", "TuneError", "TuneSpec", "Tuner", "rows_ladder"]
