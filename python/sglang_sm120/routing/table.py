"""The routing table: for each message size (bytes, dtype, plain or fused) the route that serves it, with the
measured time of every candidate and of NCCL, keyed by the box and the software it was measured with. Pure: no
torch, no SGLang, no I/O (routing/cache.py reads and writes the files).

A route is one launch of our kernels (`sgl_kernel_sm120.policy.Route`), written 'sm120/ONESHOT/push/device/b188/c4',
or NCCL (for a fused call: NCCL, then SGLang's own add + RMSNorm), written 'nccl' and held as None.

The rule (`choose`), NCCL the incumbent: a candidate of ours is eligible at a size only where it beat NCCL there by
at least MIN_GAIN, inside a run of at least SUSTAIN consecutive measured sizes where it did, so no measured size goes
to our kernels where NCCL was as fast; one of ours displaces another of ours only with the same sustained gain over
it; a failed candidate has no time and is never routed to. A size between two measured ones goes to ours only where
both neighbours chose that same route; below the smallest measured size, its route; above the largest, NCCL
(`lookup` returns None). A table read back is chosen again from its measurements (`RoutingTable.rederived`), so a
hand-edited route is not served as stored.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sgl_kernel_sm120.policy import DTYPES, Memory, Route

# Bump FORMAT_VERSION on an incompatible change of the JSON, TUNE_VERSION when the tuner measures differently
# (candidates, verification, timing, rule): a table with another value of either is stale.
FORMAT_VERSION = 1
TUNE_VERSION = 5  # 5: one checked burst ranks every candidate, the fastest are profiled

KINDS = ("plain", "fused")
NCCL = "nccl"
OURS = "sm120"

MIN_GAIN, SUSTAIN = 0.02, 2
RULE = {"min_gain": MIN_GAIN, "sustain": SUSTAIN}

# Key fields: a difference in a software field makes a table "other versions", in a box field "another key"; either
# way it is not used. NCCL's settings are software: NCCL configured otherwise is another incumbent. "launch" is how
# the workspace launches (core/facts.launch_facts): the same route runs another launch otherwise.
VERSION_FIELDS = ("driver", "cuda", "torch", "nccl", "nccl_settings", "sglang_sm120", "kernels")
BOX_FIELDS = ("world_size", "gpus", "islands", "p2p", "memory", "launch")
OTHER_VERSIONS, ANOTHER_KEY = "other versions", "another key"


class TableError(ValueError):
    """A table document that does not have the shape this module writes."""


def route_id(route: Route | None) -> str:
    return NCCL if route is None else f"{OURS}/{route.id}"


def route_label(route: Route | None) -> str:
    return "NCCL" if route is None else route.id


def parse_route(text: str) -> Route | None:
    if text == NCCL:
        return None
    backend, _, launch = str(text).partition("/")
    if backend != OURS:
        raise TableError(f"bad route {text!r}: expected 'nccl' or '{OURS}/VARIANT/TRANSPORT/MEMORY[/bN][/cN][/tN]'")
    try:
        return Route.parse(launch)
    except ValueError as exc:
        raise TableError(f"bad route {text!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured size: per candidate id, its profile (the median over replays of the slowest rank, us), or why it
    failed; `ranked`: the burst's time (its best replay's slowest rank) of each candidate that passed but was not
    profiled."""

    rows: int
    nbytes: int
    times: Mapping[str, float]
    failed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ranked: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Entry:
    """Sizes low..high bytes (inclusive) of one dtype and kind go to `route` (None: NCCL)."""

    dtype: str
    kind: str
    low: int
    high: int
    route: Route | None


def _beats(candidate: float | None, incumbent: float | None, min_gain: float) -> bool:
    return candidate is not None and incumbent is not None and candidate <= (1.0 - min_gain) * incumbent


def _in_long_runs(flags: Sequence[bool], length: int) -> list[bool]:
    """True at the positions inside a run of at least `length` consecutive True values."""
    runs = [(flag, len(list(run))) for flag, run in itertools.groupby(flags)]
    return [flag and count >= length for flag, count in runs for _ in range(count)]


def choose(points: Sequence[Point], *, min_gain: float = MIN_GAIN, sustain: int = SUSTAIN) -> list[Route | None]:
    """The route of every point (ascending sizes), by the rule in the module docstring."""
    if any(b.nbytes <= a.nbytes for a, b in zip(points, points[1:], strict=False)):
        raise ValueError("points must be in strictly ascending size order")
    ours = sorted({cid for p in points for cid in p.times if cid != NCCL})
    times = {cid: [p.times.get(cid) for p in points] for cid in ours + [NCCL]}
    sustained = {cid: _in_long_runs([_beats(t, n, min_gain) for t, n in zip(times[cid], times[NCCL], strict=True)],
                                    sustain) for cid in ours}
    chosen, current = [], NCCL
    for i in range(len(points)):
        contenders = [cid for cid in ours if sustained[cid][i]]
        fallback = current if current in contenders else NCCL
        if fallback != NCCL:  # displaced only by one sustainedly faster here and at the next size
            contenders = [cid for cid in contenders if cid != current and i + 1 < len(points) and sustained[cid][i + 1]
                          and all(_beats(times[cid][k], times[current][k], min_gain) for k in (i, i + 1))]
        current = min(((times[cid][i], cid) for cid in contenders), default=(0, fallback))[1]
        chosen.append(parse_route(current))
    return chosen


def ranges(points: Sequence[Point], routes: Sequence[Route | None], dtype: str, kind: str) -> list[Entry]:
    """Byte ranges from per-point routes, by the rule in the module docstring; adjacent equal routes merge."""
    merged: list[Entry] = []

    def add(low: int, high: int, route: Route | None) -> None:
        if merged and merged[-1].route == route and merged[-1].high + 1 == low:
            merged[-1] = dataclasses.replace(merged[-1], high=high)
        else:
            merged.append(Entry(dtype, kind, low, high, route))

    low = 1
    for i, (point, route) in enumerate(zip(points, routes, strict=True)):
        if point.nbytes > low:
            add(low, point.nbytes - 1, route if i == 0 or (route is not None and routes[i - 1] == route) else None)
        add(point.nbytes, point.nbytes, route)
        low = point.nbytes + 1
    return merged


def without_blamed(points: Sequence[Point], dtype: str, kind: str,
                   blamed: Sequence[Mapping[str, Any]]) -> list[Point]:
    """The points with every candidate blamed for a crash or hang ({dtype, kind, candidate, from_bytes, reason})
    moved from the times to the failures, from its size up."""
    out = []
    for point in points:
        gone = {str(b["candidate"]): str(b.get("reason") or "blamed for a crash or hang") for b in blamed
                if b.get("dtype") == dtype and b.get("kind") == kind and point.nbytes >= int(b.get("from_bytes", 0))
                and b.get("candidate") in point.times}
        if gone:
            point = Point(point.rows, point.nbytes, {c: t for c, t in point.times.items() if c not in gone},
                          {**point.failed, **{c: f"blamed: {why}" for c, why in gone.items()}}, point.ranked)
        out.append(point)
    return out


def make_key(local: Sequence[Mapping[str, Any]], *, islands: Sequence[Sequence[int]] | None,
             p2p: Sequence[Sequence[bool]] | None, memory: str,
             launch: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The table key of a group from every rank's key facts (rank order; core/facts.key_facts) and the group's
    islands, P2P matrix, workspace memory and launch facts. A version that differs between ranks is kept as 'a | b'."""
    key: dict[str, Any] = {
        "world_size": len(local),
        "gpus": [{"uuid": f.get("uuid"), "pci_bus_id": f.get("pci_bus_id"), "name": f.get("name")} for f in local],
        "islands": [list(map(int, g)) for g in islands] if islands else None,
        "p2p": [[bool(v) for v in row] for row in p2p] if p2p is not None else None,
        "memory": Memory(memory).value,
        "launch": json.loads(_canonical(dict(launch))) if launch is not None else None,
    }
    for field in VERSION_FIELDS:
        values = [f.get(field) for f in local]
        values = [v for i, v in enumerate(values) if v not in values[:i]]
        key[field] = values[0] if len(values) == 1 else " | ".join(
            _canonical(v) if isinstance(v, dict) else str(v) for v in values)
    return key


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def digest(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()


def box_tag(key: Mapping[str, Any]) -> str:
    """Eight hex digits naming the GPUs of a key (their UUIDs in rank order), for the cache file name."""
    return digest([g.get("uuid") for g in key.get("gpus") or []])[:8]


def compare_keys(expected: Mapping[str, Any], found: Mapping[str, Any]) -> tuple[str, str] | None:
    """None when `found` (a table's key) is `expected` (this group's); else (OTHER_VERSIONS | ANOTHER_KEY, what
    differs, as 'field table-value -> this-value')."""
    for status, fields in ((OTHER_VERSIONS, VERSION_FIELDS), (ANOTHER_KEY, BOX_FIELDS)):
        out = []
        for field in (f for f in fields if expected.get(f) != found.get(f)):
            mine, theirs = expected.get(field), found.get(field)
            if field == "gpus" and isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
                out.append(f"gpus of ranks {[r for r in range(len(mine)) if mine[r] != theirs[r]]} differ")
            else:
                out.append(f"{field} {theirs!r} -> {mine!r}")
        if out:
            return status, "; ".join(out)
    return None


@dataclasses.dataclass
class RoutingTable:
    key: dict[str, Any]
    measured: str  # ISO 8601, UTC
    workload: dict[str, Any]  # hidden, rows, dtypes, kinds, max_bytes
    entries: list[Entry]
    measurements: dict[tuple[str, str], list[Point]]  # (dtype, kind) -> points, ascending
    quick: bool = False
    durations: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds: "measure", "total"
    incumbents: dict[str, str] = dataclasses.field(default_factory=dict)  # kind -> what the NCCL route ran
    notes: list[str] = dataclasses.field(default_factory=list)
    rule: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(RULE))
    tune_version: int = TUNE_VERSION
    planned: str = ""  # the digest of what the tool sees once its ranks ran (tuning/processes.planned)

    @classmethod
    def from_points(cls, key, measured, workload, measurements, **kwargs) -> RoutingTable:
        rule = kwargs.get("rule") or RULE
        entries = [entry for (dtype, kind), points in sorted(measurements.items())
                   for entry in ranges(points, choose(points, min_gain=rule["min_gain"], sustain=rule["sustain"]),
                                       dtype, kind)]
        return cls(key=dict(key), measured=measured, workload=dict(workload), entries=entries,
                   measurements={k: list(v) for k, v in measurements.items()}, **kwargs)

    def rederived(self, blamed: Sequence[Mapping[str, Any]] = ()) -> RoutingTable:
        """This table with its routes chosen again from its measurements by its rule, without the candidates in
        `blamed` (see without_blamed)."""
        measurements = {(dtype, kind): without_blamed(points, dtype, kind, blamed)
                        for (dtype, kind), points in self.measurements.items()}
        kept = ("quick", "durations", "incumbents", "notes", "rule", "tune_version", "planned")
        return RoutingTable.from_points(self.key, self.measured, self.workload, measurements,
                                        **copy.deepcopy({field: getattr(self, field) for field in kept}))

    def routes_for(self, dtype: str, kind: str) -> list[Entry]:
        return [e for e in self.entries if e.dtype == dtype and e.kind == kind]

    def largest(self, dtype: str, kind: str) -> int:
        """The largest size this table covers for (dtype, kind); 0 when none."""
        return max((e.high for e in self.routes_for(dtype, kind)), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION, "tune_version": self.tune_version, "key": self.key, "measured": self.measured,
            "quick": self.quick, "durations": self.durations, "workload": self.workload, "rule": self.rule,
            "incumbents": self.incumbents, "notes": self.notes, "planned": self.planned,
            "entries": [{"dtype": e.dtype, "kind": e.kind, "low": e.low, "high": e.high, "route": route_id(e.route)}
                        for e in self.entries],
            "measurements": [
                {"dtype": dtype, "kind": kind, "rows": p.rows, "bytes": p.nbytes, "timed": len(p.times),
                 "times": {k: float(v) for k, v in sorted(p.times.items())}, "failed": dict(sorted(p.failed.items())),
                 "ranked": {k: float(v) for k, v in sorted(p.ranked.items())}}
                for (dtype, kind), points in sorted(self.measurements.items()) for p in points
            ],
        }

    def digest(self) -> str:
        return digest(self.to_dict())

    @classmethod
    def from_dict(cls, doc: Any) -> RoutingTable:
        """Parse what to_dict wrote; TableError names the first thing that is wrong. The caller checks the format and
        tune versions (they make a table stale, not corrupt)."""
        if not isinstance(doc, Mapping):
            raise TableError("the document is not a JSON object")
        for field in ("key", "measured", "workload", "entries", "measurements"):
            if field not in doc:
                raise TableError(f"'{field}' is missing")
        if not isinstance(doc["key"], Mapping) or not isinstance(doc["workload"], Mapping):
            raise TableError("'key' and 'workload' must be objects")
        entries = _parse_list(doc, "entries", "entry", _entry)
        ordered = sorted(entries, key=lambda e: (e.dtype, e.kind, e.low))
        for a, b in zip(ordered, ordered[1:], strict=False):
            if (a.dtype, a.kind) == (b.dtype, b.kind) and b.low <= a.high:
                raise TableError(f"overlapping {a.dtype} {a.kind} entries")
        measurements: dict[tuple[str, str], list[Point]] = {}
        for where, point in _parse_list(doc, "measurements", "measurement", _point):
            measurements.setdefault(where, []).append(point)
        for (dtype, kind), points in measurements.items():
            if kind not in KINDS or dtype not in DTYPES:
                raise TableError(f"measurements of {dtype!r} {kind!r}: a kind of {KINDS} and a dtype of {DTYPES}")
            if any(b.nbytes <= a.nbytes for a, b in zip(points, points[1:], strict=False)):
                raise TableError(f"{dtype} {kind} measurements are not in strictly ascending size order")
        try:
            rule = dict(doc.get("rule") or RULE)
            rule = {"min_gain": float(rule["min_gain"]), "sustain": int(rule["sustain"])}
            if not (0 <= rule["min_gain"] < 1 and rule["sustain"] >= 1):
                raise ValueError("min_gain in [0, 1) and sustain >= 1")
            hidden = int(doc["workload"].get("hidden"))
            if hidden < 1:
                raise ValueError("the workload's hidden size must be >= 1")
            return cls(
                key=dict(doc["key"]), measured=str(doc["measured"]), workload=dict(doc["workload"]), entries=entries,
                measurements=measurements, quick=bool(doc.get("quick", False)),
                durations={str(k): float(v) for k, v in dict(doc.get("durations") or {}).items()},
                incumbents={str(k): str(v) for k, v in dict(doc.get("incumbents") or {}).items()},
                notes=[str(n) for n in doc.get("notes") or []], rule=rule,
                tune_version=int(doc.get("tune_version", TUNE_VERSION)), planned=str(doc.get("planned") or ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise TableError(f"bad rule, workload, durations, incumbents or notes: {type(exc).__name__}: {exc}") \
                from None

    def coverage_gap(self, dtype: str, hidden: int, kinds: Iterable[str] = KINDS) -> str | None:
        """Why this table cannot route a server of this dtype and hidden size; None when it can (sizes past its
        largest measured one go to NCCL)."""
        if int(self.workload.get("hidden") or 0) != int(hidden):
            return f"measured at hidden {self.workload.get('hidden')}, this server has hidden {hidden}"
        missing = [kind for kind in kinds if self.largest(dtype, kind) == 0]
        return f"no {dtype} {', '.join(missing)} routes" if missing else None

    def versus_nccl(self, dtype: str, kind: str, rows: int) -> tuple[Route | None, float | None, float | None]:
        """At the measured size of `rows` rows: (the route chosen there, its time, NCCL's time) in us; Nones
        where nothing was measured."""
        point = next((p for p in self.measurements.get((dtype, kind), []) if p.rows == rows), None)
        if point is None:
            return None, None, None
        route = lookup(self, point.nbytes, dtype, kind == "fused")
        return route, point.times.get(route_id(route)) if route else None, point.times.get(NCCL)


def _parse_list(doc: Mapping[str, Any], field: str, what: str, parse) -> list:
    if not isinstance(doc[field], list):
        raise TableError(f"'{field}' must be a list")
    parsed = []
    for raw in doc[field]:
        try:
            parsed.append(parse(raw))
        except (KeyError, TypeError, ValueError) as exc:
            raise TableError(f"bad {what} {raw!r}: {exc}") from None
    return parsed


def _entry(raw: Any) -> Entry:
    entry = Entry(str(raw["dtype"]), str(raw["kind"]), int(raw["low"]), int(raw["high"]), parse_route(raw["route"]))
    if entry.kind not in KINDS or entry.dtype not in DTYPES or not 1 <= entry.low <= entry.high:
        raise ValueError(f"a kind of {KINDS}, a dtype of {DTYPES} and 1 <= low <= high")
    return entry


def _point(raw: Any) -> tuple[tuple[str, str], Point]:
    times = {str(k): float(v) for k, v in dict(raw["times"]).items()}
    failed = {str(k): str(v) for k, v in dict(raw.get("failed") or {}).items()}
    ranked = {str(k): float(v) for k, v in dict(raw.get("ranked") or {}).items()}
    for cid in [*times, *failed, *ranked]:
        parse_route(cid)
    return (str(raw["dtype"]), str(raw["kind"])), Point(int(raw["rows"]), int(raw["bytes"]), times, failed, ranked)


def lookup(table: RoutingTable, nbytes: int, dtype: str, fused: bool) -> Route | None:
    """The route of a message of `nbytes` bytes; None when the table does not cover that size (the caller then
    uses NCCL). A scan of a few entries: callers memoize per size."""
    entries = table.routes_for(dtype, "fused" if fused else "plain")
    return next((e.route for e in entries if e.low <= nbytes <= e.high), None)


def describe(table: RoutingTable, dtype: str, kind: str, up_to: int | None = None) -> str:
    """'ONESHOT/push/device up to 43008 B, NCCL up to 1835008 B' for one dtype and kind (cut at `up_to`)."""
    entries = sorted(table.routes_for(dtype, kind), key=lambda e: e.low)
    return ", ".join(f"{route_label(e.route)} up to {e.high if up_to is None else min(e.high, up_to)} B"
                     for e in entries if up_to is None or e.low <= up_to) or "none"


def route_differences(stored: RoutingTable, derived: RoutingTable) -> str:
    """'' when both tables route alike; else, per dtype and kind that differs, both routings (for a WARNING)."""
    out = []
    for dtype, kind in sorted({(e.dtype, e.kind) for e in stored.entries + derived.entries}):
        was, now = describe(stored, dtype, kind), describe(derived, dtype, kind)
        if was != now:
            out.append(f"{dtype} {kind}: stored {was}; from its measurements {now}")
    return "; ".join(out)
