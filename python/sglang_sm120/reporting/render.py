"""Markdown for a routing table and for benchmark result documents: what the tuner prints, the doctor shows and
the report pastes into an issue. Pure; no torch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..routing.table import NCCL, RoutingTable, lookup, parse_route, route_id, route_label


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


# ---------------------------------------------------------------------------------------------------------
# benchmark result documents


def allreduce_doc_markdown(doc: Mapping[str, Any]) -> str:
    """bench_allreduce: per op, rows x implementation medians."""
    results = [r for r in doc.get("results", []) if r.get("rows") is not None]
    parts = []
    for op in sorted({r["op"] for r in results}):
        mine = [r for r in results if r["op"] == op]
        impls = sorted({r.get("label") or r["impl"] for r in mine})
        rows = []
        for n in sorted({r["rows"] for r in mine}):
            row: list[Any] = [n]
            for impl in impls:
                found = [r for r in mine if r["rows"] == n and (r.get("label") or r["impl"]) == impl]
                if not found:
                    row.append("")
                elif found[0].get("error"):
                    row.append("error")
                else:
                    row.append(f"{found[0]['median_us']:.2f}")
            rows.append(row)
        parts += [f"{op}, us per call:", "", md_table(["rows"] + impls, rows), ""]
    skipped = list(dict.fromkeys(f"{s['impl']}: {s['reason']}" for s in doc.get("skipped") or []))
    if skipped:
        parts.append("Skipped: " + "; ".join(skipped))
    return "\n".join(parts).strip()


def verify_doc_markdown(doc: Mapping[str, Any]) -> str:
    """bench_verify: per compute mode, tokens x backend step time."""
    results = doc.get("results", [])
    parts = []
    for compute in sorted({r["compute"] for r in results}):
        mine = [r for r in results if r["compute"] == compute]
        backends = sorted({r["backend"] for r in mine})
        rows = []
        for tokens in sorted({r["tokens"] for r in mine}):
            row: list[Any] = [tokens]
            for backend in backends:
                found = [r for r in mine if r["tokens"] == tokens and r["backend"] == backend]
                row.append(f"{found[0]['step_us']:.1f}" if found else "")
            rows.append(row)
        parts += [f"compute {compute}, us per verify forward:", "", md_table(["tokens"] + backends, rows), ""]
    return "\n".join(parts).strip()


def hardware_line(doc: Mapping[str, Any]) -> str:
    hw = doc.get("hardware") or {}
    return (f"{hw.get('gpu')} x{hw.get('world_size')}, driver {hw.get('driver')}, CUDA {hw.get('cuda')}, "
            f"torch {hw.get('torch')}, NCCL {hw.get('nccl')}, {doc.get('date')}")


def _value(value: Any) -> Any:
    return f"{value:.2f}" if isinstance(value, float) else value


def rows_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """A list of flat records as one table, its columns the records' keys in first-seen order."""
    columns = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, Mapping | list)))
    return md_table(columns, [[_value(r.get(c)) for c in columns] for r in rows])


def records_doc_markdown(doc: Mapping[str, Any]) -> str:
    """bench_transports / bench_polling / bench_tuner_pick: what it measured, its summary (or comparisons), and the
    count of its records (the file holds them; a wrong result is listed)."""
    records = doc.get("records") or []
    parts = [str(doc.get("what") or ""), f"note: {doc.get('note')}" if doc.get("note") else ""]
    summary = doc.get("summary") if doc.get("summary") is not None else doc.get("comparisons")
    groups = summary.items() if isinstance(summary, Mapping) else [("summary", summary or [])]
    for name, rows in groups:
        if rows:
            parts += [f"{name}:", "", rows_markdown(rows)]
    wrong = [r for r in records if r.get("result_correct") is False]
    parts.append(f"{len(records)} records in the file; {len(wrong)} with a wrong result")
    if wrong:
        parts += ["", rows_markdown(wrong)]
    return "\n\n".join(p for p in parts if p)


def trap_delivery_markdown(doc: Mapping[str, Any]) -> str:
    """scripts/diagnose_trap_delivery.py: each rank's end state and its last event."""
    rows = []
    for rank, view in sorted((doc.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        events = (view or {}).get("events") or [{}]
        last = events[-1]
        detail = str(last.get("detail") or "").splitlines()[0][:160] if last.get("detail") else ""
        rows.append([rank, (view or {}).get("state"), last.get("event"), last.get("at_s"), detail])
    lines = len(doc.get("dmesg_xid") or [])
    return (f"kernel timeout {doc.get('kernel_timeout_s')} s, abort after {doc.get('abort_after_s')} s; "
            f"{lines} dmesg lines in the file\n\n" + md_table(["rank", "state", "last event", "at s", "detail"], rows))
