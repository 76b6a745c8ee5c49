"""The tune of one TP group, run on every rank in lockstep. For each dtype, kind and size: NCCL, the incumbent, is
profiled; every candidate (tuning/candidates.py) is checked exact in a burst of graph replays whose times rank it
(one pass, tuning/burst.py); the fastest few that passed (a fixed count, the same list on every rank: the times are
agreed first) and the previous size's fastest are profiled like NCCL; `routing.table.choose` turns the profiles into
routes. Every collective step is a gather over the group's gloo group, so all ranks see the same lists and take the
same branches. A candidate that fails is recorded with its reason, never routed to nor tried at larger sizes, and
the workspaces are rebuilt after it.
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
# Pruning: a candidate whose burst was slower than PRUNE_FACTOR x NCCL at PRUNE_SIZES consecutive sizes is not tried
# at larger ones (NCCL gains on our kernels as sizes grow), and once none of ours is left NCCL serves the larger
# sizes untimed. It compares with NCCL only, never with another candidate of ours: one slower than ONESHOT at a few
# rows may still win at many.
PRUNE_FACTOR = 1.5
PRUNE_SIZES = 2
# The quick tune (the launcher's): short graphs and profiles, and the three fastest of the burst profiled per size.
QUICK_TIMING = {"calls": 4, "warmup": 2, "iters": 8, "survivors": 3}


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
    calls: int = 10  # calls captured per graph
    burst: int = 2  # checked replays back to back; their times rank the candidates
    warmup: int = 3  # untimed replays before a profile
    iters: int = 20  # a profile's timed replays
    survivors: int = 0  # candidates profiled per size besides the previous size's fastest; 0: every one that passed
    kernel_timeout_s: float = 5.0  # a kernel wait longer than this fails the candidate (on_timeout="exit")
    # Candidates the parent excluded after one killed a process: dtype, kind, candidate, from_bytes, reason.
    exclude: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    graph_rows: list[int] = dataclasses.field(default_factory=list)  # graph_rows(), each measured
    # Debug only, where NCCL cannot start (ranks sharing a GPU): NCCL's time is this value, and the table says so.
    debug_nccl_us: float | None = None

    @property
    def rows(self) -> list[int]:
        return rows_ladder(self.max_rows, self.quick, self.graph_rows)

    @classmethod
    def make(cls, hidden: int, max_rows: int, *, quick: bool, **kwargs) -> TuneSpec:
        timing = QUICK_TIMING if quick else {}
        return cls(hidden=int(hidden), max_rows=int(max_rows), quick=quick, **{**timing, **kwargs})

    def excluded(self, dtype: str, kind: str, candidate: str, nbytes: int) -> str | None:
        for rule in self.exclude:
            if (rule.get("dtype"), rule.get("kind"), rule.get("candidate")) == (dtype, kind, candidate) and \
                    nbytes >= int(rule.get("from_bytes", 0)):
                return str(rule.get("reason", "excluded"))
        return None


class Tuner:
    """`measurer` is one rank's GPU side (tuning/measure.py): shape() and limits() of its workspace and kernel
    library, incumbent(kind) in words, trial(route, kind, dtype, rows, profile) -> (digest of its checked outputs,
    us per call per timed replay: the burst's, or with `profile` the profile's), reset() after a failure; a route of
    None is NCCL (profiled, nothing checked). Those that build or free a workspace are collective: the Tuner calls
    them on every rank at the same point."""

    def __init__(self, measurer, spec: TuneSpec, *, rank: int, world: int, gather: Callable[[Any], list],
                 key: Mapping[str, Any], progress: Callable[[dict], None] | None = None):
        self.measurer, self.spec, self.rank, self.world = measurer, spec, rank, world
        self.gather, self.key, self.progress = gather, dict(key), progress or (lambda event: None)
        self.notes: list[str] = []
        self.counts = {"ranked": 0, "profiled": 0, "failed": 0, "skipped": 0}  # candidate x size pairs

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

    def _trial(self, cid: str, route: Route | None, kind: str, dtype: str, rows: int,
               profile: bool) -> tuple[float | None, str | None]:
        """(the slowest rank's us per call: the median over a profile's replays, the best replay of a burst, None)
        or (None, why it failed), the same on every rank: every rank's outcome is gathered in one round."""
        self.progress({"event": "begin", "dtype": dtype, "kind": kind, "rows": rows,
                       "bytes": rows * self.spec.hidden * ELEMENT_BYTES, "candidate": cid,
                       "pass": "profile" if profile else "burst"})
        if route is None and self.spec.debug_nccl_us is not None:
            gathered = self._agreed((None, None, [float(self.spec.debug_nccl_us)] * max(1, self.spec.iters)))
        else:
            try:
                local = (None, *self.measurer.trial(route, kind, dtype, rows, profile))
            except Exception as exc:  # noqa: BLE001 - recorded, agreed, never routed to
                # a wrong output is a verification failure in whichever pass its check ran
                what = "profile" if profile and not isinstance(exc, AssertionError) else "verify"
                local = (f"{what}: {short_error(exc)}", None, None)
            gathered = self._agreed(local)
        verdict = reduce_verdicts([(err, digest) for err, digest, _ in gathered])
        if verdict is not None:
            return None, verdict
        try:
            spread = aggregate_iteration_times([times for _, _, times in gathered])
        except ValueError as exc:
            return None, f"timing: {exc}"
        return float(spread["median_us"] if profile else spread["min_us"]), None

    def _fail(self, cid: str, route: Route | None, why: str, rows: int, nbytes: int, failed: dict,
              stopped: dict, dtype: str, kind: str) -> None:
        failed[cid] = why
        stopped.setdefault(cid, (rows + 1, f"failed at {nbytes} B: {why}"))
        self.counts["failed"] += 1
        if route is not None:
            self.measurer.reset()
        else:
            self.notes.append(f"{dtype} {kind}: NCCL failed at {nbytes} B ({why}); no size from there on is routed "
                              "to our kernels, for want of an NCCL time to beat")

    def _trials(self, cids, ours, kind, dtype, rows, nbytes, profile, failed, stopped) -> dict[str, float]:
        """Each candidate's agreed time (the burst's or, with `profile`, the profile's); a failure is recorded."""
        out = {}
        for cid in cids:
            us, why = self._trial(cid, ours[cid], kind, dtype, rows, profile)
            self.counts["profiled" if profile else "ranked"] += 1
            if us is None:
                self._fail(cid, ours[cid], why, rows, nbytes, failed, stopped, dtype, kind)
            else:
                out[cid] = us
        return out

    def _measure(self, dtype: str, kind: str, shape: WorkspaceShape, limits: KernelLimits) -> list[Point]:
        """Every size of the ladder with every candidate, ascending (a failure or a prune holds from its size up);
        then, in a quick tune, every other captured size with the candidates profiled at the ladder's sizes on
        either side of it."""
        spec, points = self.spec, {}
        ladder = rows_ladder(spec.max_rows, spec.quick) if spec.quick else spec.rows
        stopped: dict[str, tuple[int, str]] = {}  # candidate id -> (from rows, why) it is not tried there and above
        losing: dict[str, int] = {}  # candidate id -> consecutive sizes slower than PRUNE_FACTOR x NCCL
        previous_best: str | None = None  # the fastest profile of ours at the last size
        for rows in ladder:
            points[rows], ranked = self._size(dtype, kind, rows, shape, limits, stopped, None, previous_best)
            times = points[rows].times
            previous_best = min((c for c in times if c != NCCL), key=lambda c: (times[c], c), default=None)
            nccl = times.get(NCCL)
            for cid, us in ranked.items():
                losing[cid] = losing.get(cid, 0) + 1 if nccl is not None and us > PRUNE_FACTOR * nccl else 0
                if losing[cid] >= PRUNE_SIZES and cid not in stopped:
                    stopped[cid] = (rows + 1, f"pruned: slower than {PRUNE_FACTOR:g}x NCCL at {PRUNE_SIZES} "
                                              f"consecutive sizes up to {points[rows].nbytes} B")
        for rows in (r for r in spec.rows if r not in points):
            below = max((r for r in ladder if r < rows), default=None)
            above = min((r for r in ladder if r > rows), default=None)
            near = {c for r in (below, above) if r is not None for c in points[r].times if c != NCCL}
            points[rows], _ = self._size(dtype, kind, rows, shape, limits, stopped, near, None)
        return [points[rows] for rows in sorted(points)]

    def _size(self, dtype: str, kind: str, rows: int, shape: WorkspaceShape, limits: KernelLimits,
              stopped: dict[str, tuple[int, str]], only: set[str] | None,
              previous_best: str | None) -> tuple[Point, dict[str, float]]:
        """(the size's point, every candidate's burst time, profiled ones included): NCCL profiled, every candidate
        checked in a burst, the fastest few (every one in a full tune) and `previous_best` profiled; with `only`, those
        candidates profiled, each checked by its profile's own burst. A failure stops its candidate from here up."""
        spec, nbytes = self.spec, rows * self.spec.hidden * ELEMENT_BYTES
        ours = {route_id(r): r for r in cand.candidates(kind, nbytes, spec.hidden, shape, limits, spec.quick)}
        if only is not None:
            ours = {cid: r for cid, r in ours.items() if cid in only}
        failed: dict[str, str] = {}
        for cid in ours:
            if cid in stopped and stopped[cid][0] <= rows:
                failed[cid] = stopped[cid][1]
            elif why := spec.excluded(dtype, kind, cid, nbytes):
                failed[cid] = why
        self.counts["skipped"] += len(failed)
        times: dict[str, float] = {}
        left = [cid for cid in ours if cid not in failed]
        if NCCL in stopped and stopped[NCCL][0] <= rows:  # no NCCL time to beat: nothing of ours is tried
            failed.update({NCCL: stopped[NCCL][1], **{cid: "not tried: NCCL failed" for cid in left}})
            left = []
        if not left:  # none of ours left: NCCL serves untimed
            if ours:
                failed.setdefault(NCCL, "not timed: no candidate of ours left to compare with")
            return Point(rows=rows, nbytes=nbytes, times=times, failed=failed), {}
        nccl, why = self._trial(NCCL, None, kind, dtype, rows, profile=True)
        if nccl is None:
            self._fail(NCCL, None, why, rows, nbytes, failed, stopped, dtype, kind)
            failed.update({cid: "not tried: NCCL failed" for cid in left})
            left = []
        else:
            times[NCCL] = nccl
        if only is not None:  # every one is profiled: its profile's own burst checks it, one pass, not two
            ranked, chosen = {}, left
        else:  # the burst: every candidate checked exact, its best replay ranks it
            ranked = self._trials(left, ours, kind, dtype, rows, nbytes, False, failed, stopped)
            order = sorted(ranked, key=lambda c: (ranked[c], c))  # agreed numbers: the same list on every rank
            chosen = order[:spec.survivors] if spec.survivors > 0 else order
        if previous_best in ranked and previous_best not in chosen:
            chosen.append(previous_best)  # so a route can keep its sustained run
        times.update(self._trials(chosen, ours, kind, dtype, rows, nbytes, True, failed, stopped))
        point = Point(rows=rows, nbytes=nbytes, times=times, failed=failed,
                      ranked={c: us for c, us in ranked.items() if c not in times})
        return point, ranked

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
                      "max_bytes": spec.max_rows * spec.hidden * ELEMENT_BYTES, "workspace": shape.as_dict(),
                      "pairs": dict(self.counts)},
            measurements=measurements, durations={"measure": round(max(s for _, s in clocks), 3)},
            incumbents={kind: self.measurer.incumbent(kind) for kind in spec.kinds})
        digests = self._agreed(table.digest())
        if any(d != digests[0] for d in digests):
            raise TuneError("the ranks built different tables from the same measurements")
        return table

