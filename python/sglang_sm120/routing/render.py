"""A routing table as markdown, as the tune prints it and the doctor shows it. Pure; no torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .table import NCCL, RoutingTable, lookup, parse_route, route_id, route_label


def _md_table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    def line(cells):
        return "| " + " | ".join("" if c is None else str(c).replace("|", "\\|").replace("\n", " ")
                                 for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(row) for row in rows])


def ranges_markdown(table: RoutingTable) -> str:
    rows = [[e.dtype, e.kind, e.low, e.high, route_label(e.route)]
            for e in sorted(table.entries, key=lambda e: (e.dtype, e.kind, e.low))]
    return _md_table(["dtype", "kind", "from B", "to B", "route"], rows)


def _cell(point, cid: str, routed: bool) -> str:
    if cid in point.times:
        return f"**{point.times[cid]:.2f}**" if routed else f"{point.times[cid]:.2f}"
    why = point.failed.get(cid)
    if why is None:
        return ""
    return ("n/a" if "not available" in why else "pruned" if why.startswith("pruned") else "-"
            if why.startswith("not timed") else "failed")


def _measurements(table: RoutingTable, dtype: str, kind: str) -> str:
    """Sizes x candidates, us; the routed one in bold."""
    points = table.measurements.get((dtype, kind), [])
    if not points:
        return "(nothing measured)"
    ids = sorted({cid for p in points for cid in [*p.times, *p.failed]}, key=lambda c: (c != NCCL, c))
    rows = [[p.rows, p.nbytes] + [_cell(p, cid, route_id(lookup(table, p.nbytes, dtype, kind == "fused")) == cid)
                                  for cid in ids] for p in points]
    return _md_table(["rows", "bytes"] + [route_label(parse_route(c)) for c in ids], rows)


def _failures(table: RoutingTable) -> str:
    seen: dict[tuple[str, str], str] = {}
    for (dtype, kind), points in sorted(table.measurements.items()):
        for p in points:
            for cid, why in p.failed.items():
                if not why.startswith(("failed at ", "pruned", "not timed", "not available")):
                    seen.setdefault((cid, why), f"{dtype} {kind} rows {p.rows}")  # the first failure, not its echoes
    return "\n".join(f"- {route_label(parse_route(cid))} ({where}): {why}"
                     for (cid, why), where in seen.items()) or "none"


def _key(key) -> list[str]:
    gpus = key.get("gpus") or []
    lines = [f"- TP size {key.get('world_size')}, workspace memory {key.get('memory')}, islands "
             f"{key.get('islands') or 'none'}",
             f"- GPUs: {', '.join(sorted({str(g.get('name')) for g in gpus})) or '?'}; PCI bus ids "
             f"{[g.get('pci_bus_id') for g in gpus]}",
             f"- driver {key.get('driver')}, CUDA {key.get('cuda')}, torch {key.get('torch')}, NCCL {key.get('nccl')}, "
             f"sglang-sm120 {key.get('sglang_sm120')}, kernels {key.get('kernels')}"]
    if key.get("p2p"):
        missing = [(i, j) for i, row in enumerate(key["p2p"]) for j, ok in enumerate(row) if not ok]
        lines.append(f"- CUDA P2P: {'every pair' if not missing else f'missing for {missing}'}")
    return lines


def table_markdown(table: RoutingTable, *, path: str | None = None, title: str = "Routing table") -> str:
    durations = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(table.durations.items()))
    tune = f"{'quick' if table.quick else 'full'} tune" + (f"; {durations}" if durations else "")
    parts = [
        f"### {title}", "", f"- measured {table.measured} ({tune})" + (f", file `{path}`" if path else ""),
        f"- hidden {table.workload.get('hidden')}, rows {table.workload.get('rows')}, "
        f"transports in this build: {table.workload.get('transports')}",
        f"- incumbents: {', '.join(f'{k}: {v}' for k, v in sorted(table.incumbents.items())) or '?'}; rule: a "
        f"candidate beats NCCL by >= {table.rule.get('min_gain', 0) * 100:g}% over >= {table.rule.get('sustain')} "
        "consecutive sizes",
        *_key(table.key), "", "Routes:", "", ranges_markdown(table),
    ]
    for dtype, kind in sorted(table.measurements):
        parts += ["", f"{dtype} {kind}, us per call (median over replays of the slowest rank; bold: routed):", "",
                  _measurements(table, dtype, kind)]
    parts += ["", "Failed candidates:", "", _failures(table)]
    if table.notes:
        parts += ["", "Notes:", ""] + [f"- {n}" for n in table.notes]
    return "\n".join(parts)
