"""Markdown for a routing table: what the tune prints and the doctor shows. Pure; no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .table import NCCL, RoutingTable, lookup, parse_route, route_id, route_label


def _cell(value: Any) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _short(cid: str) -> str:
    return route_label(parse_route(cid))


def key_markdown(key: Mapping[str, Any]) -> str:
    gpus = key.get("gpus") or []
    names = sorted({str(g.get("name")) for g in gpus})
    lines = [
        f"- TP size {key.get('world_size')}, workspace memory {key.get('memory')}, "
        f"islands {key.get('islands') or 'none'}",
        f"- GPUs: {', '.join(names) or '?'}; PCI bus ids {[g.get('pci_bus_id') for g in gpus]}",
        f"- driver {key.get('driver')}, CUDA {key.get('cuda')}, torch {key.get('torch')}, NCCL {key.get('nccl')}, "
        f"sglang-sm120 {key.get('sglang_sm120')}, kernels {key.get('kernels')}",
    ]
    p2p = key.get("p2p")
    if p2p:
        missing = [(i, j) for i, row in enumerate(p2p) for j, ok in enumerate(row) if not ok]
        lines.append(f"- CUDA P2P: {'every pair' if not missing else f'missing for {missing}'}")
    return "\n".join(lines)


def ranges_markdown(table: RoutingTable) -> str:
    rows = []
    for entry in sorted(table.entries, key=lambda e: (e.dtype, e.kind, e.low)):
        rows.append([entry.dtype, entry.kind, entry.low, entry.high, route_label(entry.route)])
    return md_table(["dtype", "kind", "from B", "to B", "route"], rows)


def measurements_markdown(table: RoutingTable, dtype: str, kind: str) -> str:
    """Sizes x candidates, us (median over replays of the slowest rank); the routed one in bold."""
    points = table.measurements.get((dtype, kind), [])
    if not points:
        return "(nothing measured)"
    ids = sorted({cid for p in points for cid in list(p.times) + list(p.failed)}, key=lambda c: (c != NCCL, c))
    rows = []
    for p in points:
        chosen = lookup(table, p.nbytes, dtype, kind == "fused")
        row: list[Any] = [p.rows, p.nbytes]
        for cid in ids:
            if cid in p.times:
                text = f"{p.times[cid]:.2f}"
                row.append(f"**{text}**" if route_id(chosen) == cid else text)
            elif cid in p.failed:
                why = p.failed[cid]
                row.append("n/a" if "not available" in why else "pruned" if why.startswith("pruned")
                           else "-" if why.startswith("not timed") else "failed")
            else:
                row.append("")
        rows.append(row)
    return md_table(["rows", "bytes"] + [_short(c) for c in ids], rows)


def failures_markdown(table: RoutingTable) -> str:
    seen: dict[tuple[str, str], str] = {}
    for (dtype, kind), points in sorted(table.measurements.items()):
        for p in points:
            for cid, why in p.failed.items():
                if why.startswith(("failed at ", "pruned", "not timed", "not available")):
                    continue  # the first failure is listed; pruned and unavailable ones are not failures
                seen.setdefault((cid, why), f"{dtype} {kind} rows {p.rows}")
    if not seen:
        return "none"
    return "\n".join(f"- {_short(cid)} ({where}): {why}" for (cid, why), where in seen.items())


def table_markdown(table: RoutingTable, *, path: str | None = None, title: str = "Routing table") -> str:
    mode = "quick" if table.quick else "full"
    durations = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(table.durations.items()))
    parts = [
        f"### {title}",
        "",
        f"- measured {table.measured} ({mode} tune{'; ' + durations if durations else ''})"
        + (f", file `{path}`" if path else ""),
        f"- hidden {table.workload.get('hidden')}, rows {table.workload.get('rows')}, "
        f"transports in this build: {table.workload.get('transports')}",
        f"- incumbents: {', '.join(f'{k}: {v}' for k, v in sorted(table.incumbents.items())) or '?'}; rule: a "
        f"candidate beats NCCL by >= {table.rule.get('min_gain', 0) * 100:g}% over >= {table.rule.get('sustain')} "
        "consecutive sizes",
        key_markdown(table.key),
        "",
        "Routes:",
        "",
        ranges_markdown(table),
    ]
    for dtype, kind in sorted(table.measurements):
        parts += ["", f"{dtype} {kind}, us per call (median over replays of the slowest rank; bold: routed):", "",
                  measurements_markdown(table, dtype, kind)]
    parts += ["", "Failed candidates:", "", failures_markdown(table)]
    if table.notes:
        parts += ["", "Notes:", ""] + [f"- {n}" for n in table.notes]
    return "\n".join(parts)
