"""The tune of one TP group, run on every rank in lockstep: for each dtype, kind and size, NCCL and every
candidate (tuning/candidates.py) are verified, then timed; `routing.table.choose` turns the times into routes.
Every collective step is a gather over the group's gloo group, so all ranks see the same lists and take the same
branches. A candidate that fails is recorded with its reason, never routed to nor tried at larger sizes, and the
workspaces are rebuilt after it.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sgl_kernel_sm120.policy import DTYPES, ELEMENT_BYTES, KernelLimits, Route, WorkspaceShape

from ..routing.table import NCCL, Point, RoutingTable, route_id
from . import candidates as cand
from .timing import aggregate_iteration_times, short_error

# Full tune: every row count up to 16 (the decode/verify sizes that matter most), then steps of about 25%; quick:
# the sizes below, then doubling.
FULL_DENSE_ROWS = 16
QUICK_ROWS = (1, 2, 3, 4, 6, 8)
# Pruning, which keeps a full TP=8 tune near 20 s: a candidate slower than PRUNE_FACTOR x NCCL at PRUNE_SIZES
# consecutive sizes is not timed at larger ones (NCCL gains on our kernels as sizes grow), and once none of ours is
# left NCCL serves the larger sizes untimed. It compares with NCCL only, never with another candidate of ours: one
# slower than ONESHOT at a few rows may still win at many.
PRUNE_FACTOR = 1.5
PRUNE_SIZES = 2


class TuneError(RuntimeError):
    """The group cannot tune: its ranks disagree, or the spec names a dtype the kernels do not take."""


def graph_rows(batch_sizes: Sequence[int], draft_tokens: int = 1) -> list[int]:
    """The row counts a server runs in CUDA graphs: every captured batch size, and each times the draft tokens."""
    if draft_tokens < 1 or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes and draft tokens must be >= 1, got {list(batch_sizes)} x {draft_tokens}")
    return sorted({int(b) for b in batch_sizes} | {int(b) * int(draft_tokens) for b in batch_sizes})


def rows_ladder(max_rows: int, quick: bool, captured: Sequence[int] = ()) -> list[int]:
    """The row counts measured, up to and with `max_rows`, and every captured one up to it: a captured shape is
    served by its own measurement, never by the next measured size's route."""
    if max_rows < 1:
        raise ValueError("max_rows must be >= 1")
    if any(int(r) < 1 for r in captured):
        raise ValueError(f"captured row counts must be >= 1, got {sorted(captured)}")
    dense = QUICK_ROWS if quick else range(1, FULL_DENSE_ROWS + 1)
    rows = {r for r in dense if r <= max_rows} | {int(r) for r in captured if int(r) <= max_rows} | {max_rows}
    r = float(max(r for r in rows if r <= dense[-1]))
    while r < max_rows:
        r = max(r + 1, r * (2.0 if quick else 1.25))
        rows.add(min(int(r), max_rows))
    return sorted(rows)


def reduce_verdicts(gathered: Sequence[tuple[str | None, Any]]) -> str | None:
    """Every rank's (error or None, output digest), rank order -> None (passed) or why not; pure, so every rank
    reaches the same verdict."""
    if errors := "; ".join(f"rank {r}: {err}" for r, (err, _) in enumerate(gathered) if err):
        return errors
    groups: dict[Any, list[int]] = {}
    for r, (_, digest) in enumerate(gathered):
        groups.setdefault(digest, []).append(r)
    if len(groups) != 1:
        return f"outputs differ across ranks (ranks with identical bits: {', '.join(map(str, groups.values()))})"
    return None


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
    burst_replays: int = 2  # graph replays checked back to back
    kernel_timeout_s: float = 5.0  # a kernel wait longer than this fails the candidate (on_timeout="exit")
    # Candidates the parent excluded after one killed a process: dtype, kind, candidate, from_bytes, reason.
    exclude: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    graph_rows: list[int] = dataclasses.field(default_factory=list)  # graph_rows(), each measured
    if_missing: bool = False  # stop when every rank finds a table of its key
    # Debug only, where NCCL cannot start (ranks sharing a GPU): NCCL's time is this value, and the table says so.
    debug_nccl_us: float | None = None

    @property
    def rows(self) -> list[int]:
        return rows_ladder(self.max_rows, self.quick, self.graph_rows)

    @classmethod
    def make(cls, hidden: int, max_rows: int, *, quick: bool, **kwargs) -> TuneSpec:
        timing = {"calls": 10, "iters": 10, "warmup": 3} if quick else {}
        return cls(hidden=int(hidden), max_rows=int(max_rows), quick=quick, **{**timing, **kwargs})

    def excluded(self, dtype: str, kind: str, candidate: str, nbytes: int) -> str | None:
        for rule in self.exclude:
            if (rule.get("dtype"), rule.get("kind"), rule.get("candidate")) == (dtype, kind, candidate) and \
                    nbytes >= int(rule.get("from_bytes", 0)):
                return str(rule.get("reason", "excluded"))
        return None


class Tuner:
    """`measurer` is one rank's GPU side (tuning/measure.py): shape() and limits() of its workspace and kernel
    library, incumbent(kind) in words, verify(route, kind, dtype, rows) -> the digest of its checked outputs,
    time(...) -> its us per call per timed replay, reset() after a failure; a route of None is NCCL. Those that
    build or free a workspace are collective: the Tuner calls them on every rank at the same point."""

    def __init__(self, measurer, spec: TuneSpec, *, rank: int, world: int, gather: Callable[[Any], list],
                 key: Mapping[str, Any], progress: Callable[[dict], None] | None = None):
        self.measurer, self.spec, self.rank, self.world = measurer, spec, rank, world
        self.gather, self.key, self.progress = gather, dict(key), progress or (lambda event: None)
        self.notes: list[str] = []

    def _agreed(self, local: Any) -> list:
        if len(out := self.gather(local)) != self.world:
            raise TuneError(f"gather returned {len(out)} answers for {self.world} ranks")
        return out

    def _agree_setup(self) -> tuple[WorkspaceShape, KernelLimits]:
        views = self._agreed({"shape": self.measurer.shape().as_dict(), "limits": self.measurer.limits().as_dict()})
        for field, what in (("shape", "workspaces"), ("limits", "kernel libraries")):
            seen = [v[field] for v in views]
            if any(s != seen[0] for s in seen):
                raise TuneError(f"ranks see different {what}: {seen}")
        return WorkspaceShape.from_dict(views[0]["shape"]), KernelLimits(**views[0]["limits"])

    def _gathered(self, what: str, measure: Callable[[], Any]) -> list[tuple[str | None, Any]]:
        """Every rank's (error or None, what `measure` returned): a failure is agreed like a result."""
        try:
            local = (None, measure())
        except Exception as exc:  # noqa: BLE001 - recorded, agreed, never routed to
            local = (f"{what}: {short_error(exc)}", None)
        return self._agreed(local)

    def _verify_and_time(self, route: Route | None, kind: str, dtype: str,
                         rows: int) -> tuple[float | None, str | None]:
        """(median over replays of the slowest rank's us per call, None) or (None, why it failed): the verdict is
        agreed before anyone times, so it is the same on every rank."""
        if route is not None:
            verdict = reduce_verdicts(self._gathered("verify", lambda: self.measurer.verify(route, kind, dtype, rows)))
            if verdict is not None:
                return None, verdict
        if route is None and self.spec.debug_nccl_us is not None:
            gathered = self._agreed((None, [float(self.spec.debug_nccl_us)] * max(1, self.spec.iters)))
        else:
            gathered = self._gathered("timing", lambda: self.measurer.time(route, kind, dtype, rows))
        if errors := "; ".join(f"rank {r}: {err}" for r, (err, _) in enumerate(gathered) if err):
            return None, errors
        try:
            return float(aggregate_iteration_times([times for _, times in gathered])["median_us"]), None
        except ValueError as exc:
            return None, f"timing: {exc}"

    def _measure(self, dtype: str, kind: str, shape: WorkspaceShape, limits: KernelLimits) -> list[Point]:
        points: list[Point] = []
        sticky: dict[str, str] = {}  # candidate id -> why it is not tried at larger sizes
        losing: dict[str, int] = {}  # candidate id -> consecutive sizes slower than PRUNE_FACTOR x NCCL
        for rows in self.spec.rows:
            nbytes = rows * self.spec.hidden * ELEMENT_BYTES
            routes = {route_id(r): r for r in [None, *cand.candidates(kind, nbytes, self.spec.hidden, shape, limits,
                                                                      self.spec.quick)]}
            failed = {cid: why for cid in routes
                      if (why := sticky.get(cid) or self.spec.excluded(dtype, kind, cid, nbytes))}
            times: dict[str, float] = {}
            if all(cid in failed for cid in routes if cid != NCCL):  # none of ours left: NCCL serves untimed
                failed.pop(NCCL, None)
                if len(routes) > 1:
                    failed[NCCL] = "not timed: no candidate of ours left to compare with"
                routes = {}
            for cid, route in routes.items():
                if cid in failed:
                    continue
                self.progress({"event": "begin", "dtype": dtype, "kind": kind, "rows": rows, "bytes": nbytes,
                               "candidate": cid})
                us, why = self._verify_and_time(route, kind, dtype, rows)
                if us is not None:
                    times[cid] = us
                    continue
                failed[cid], sticky[cid] = why, f"failed at {nbytes} B: {why}"
                if route is not None:
                    self.measurer.reset()
                else:
                    self.notes.append(f"{dtype} {kind}: NCCL failed at {nbytes} B ({why}); no size from there on is "
                                      "routed to our kernels, for want of an NCCL time to beat")
            nccl = times.get(NCCL)
            for cid, us in times.items():
                if cid != NCCL and nccl is not None:
                    losing[cid] = losing.get(cid, 0) + 1 if us > PRUNE_FACTOR * nccl else 0
                    if losing[cid] >= PRUNE_SIZES:
                        sticky[cid] = (f"pruned: slower than {PRUNE_FACTOR:g}x NCCL at {PRUNE_SIZES} consecutive "
                                       f"sizes up to {nbytes} B")
            points.append(Point(rows=rows, nbytes=nbytes, times=times, failed=failed))
        return points

    def run(self) -> RoutingTable:
        start, spec = time.monotonic(), self.spec
        shape, limits = self._agree_setup()
        measurements: dict[tuple[str, str], list[Point]] = {}
        for dtype in spec.dtypes:
            if dtype not in DTYPES:
                raise TuneError(f"dtype {dtype!r} is not one the kernels take ({', '.join(DTYPES)})")
            for kind in spec.kinds:
                measurements[(dtype, kind)] = self._measure(dtype, kind, shape, limits)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        clocks = self._agreed((now, time.monotonic() - start))  # the table's stamp: rank 0's clock
        notes = self.notes + ([f"DEBUG: NCCL was not measured; its time was set to {spec.debug_nccl_us} us (plumbing "
                               "run, these routes mean nothing)"] if spec.debug_nccl_us is not None else [])
        table = RoutingTable.from_points(
            key=self.key, measured=clocks[0][0], quick=spec.quick, notes=notes,
            workload={"hidden": spec.hidden, "rows": spec.rows, "dtypes": list(spec.dtypes), "kinds": list(spec.kinds),
                      "max_bytes": spec.max_rows * spec.hidden * ELEMENT_BYTES, "workspace": shape.as_dict()},
            measurements=measurements, durations={"measure": round(max(s for _, s in clocks), 3)},
            incumbents={kind: self.measurer.incumbent(kind) for kind in spec.kinds})
        digests = self._agreed(table.digest())
        if any(d != digests[0] for d in digests):
            raise TuneError("the ranks built different tables from the same measurements")
        return table

