"""The P2P fingerprints the doctor prints, and what they mean: pure judgements of measured numbers (the
measurement is tuning/fabric_probe.py).

The published RTX PRO 6000 boxes differ in two ways that decide which transport is fast
(docs/design.md; the project's notes on PCIe transports):
- posted-write collapse: SM stores to peers run far slower than SM loads from them (2.6 GB/s against 27-52 GB/s
  on some boxes), worst when several GPUs behind one switch write to several root complexes at once. A
  store/load ratio far below 1, above all with every peer at once, is its fingerprint; push transports suffer,
  pull ones do not;
- driver-staged P2P: the driver reports peer access but moves the bytes through host memory, so a copy's time
  grows with its size at host-staging speed (e.g. 242 us for 114 KB) instead of costing ~1 us plus PCIe
  bandwidth.
One-way flag latency (a store to the peer's flag, the peer spinning on its own memory, and back, halved) is
~0.6-1.1 us across PCIe switches in published measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

COLLAPSE_RATIO = 0.25  # SM store / SM load bandwidth below this: posted-write collapse
STORES_WIN_RATIO = 1.25  # above this: stores beat loads
STAGED_MAX_GBPS = 2.0  # a copy whose marginal cost is slower than this...
STAGED_GROWTH = 3.0  # ...and whose time at the largest size is this many times the smallest: driver-staged


def ratio_verdict(store_gbps: float | None, load_gbps: float | None) -> tuple[float | None, str]:
    """(store/load ratio, 'posted-write collapse' | 'stores beat loads' | 'balanced' | 'unknown')."""
    if not store_gbps or not load_gbps or store_gbps <= 0 or load_gbps <= 0:
        return None, "unknown"
    ratio = store_gbps / load_gbps
    if ratio < COLLAPSE_RATIO:
        return ratio, "posted-write collapse"
    if ratio > STORES_WIN_RATIO:
        return ratio, "stores beat loads"
    return ratio, "balanced"


def growth(sizes: Sequence[int], times_us: Sequence[float]) -> dict[str, Any]:
    """Least-squares line through (bytes, us): intercept (us), marginal bandwidth (GB/s, from the slope), and
    whether that looks driver-staged (slow marginal bandwidth and a time that grows several-fold)."""
    if len(sizes) != len(times_us) or len(sizes) < 2:
        raise ValueError("need at least two (size, time) points")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times_us) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    if sxx == 0:
        raise ValueError("sizes must differ")
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times_us, strict=True)) / sxx  # us per byte
    gbps = (1e-3 / slope) if slope > 0 else float("inf")  # bytes/us = MB/s; /1e3 = GB/s
    order = sorted(range(n), key=lambda i: sizes[i])
    grows = times_us[order[-1]] >= STAGED_GROWTH * times_us[order[0]]
    return {"intercept_us": my - slope * mx, "marginal_gbps": gbps, "staged": bool(gbps < STAGED_MAX_GBPS and grows)}


@dataclasses.dataclass
class Fingerprint:
    """What fabric_probe measured: per ordered pair (src writes to / reads from dst) and with all peers at once."""

    gpus: list[int]
    pairs: list[dict[str, Any]]  # src, dst, store_gbps, load_gbps, latency_us, copy_us {bytes: us}
    all_peers: dict[str, Any]  # store_gbps, load_gbps: per GPU, every GPU to every peer at once
    errors: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Fingerprint:
        return cls(list(raw.get("gpus") or []), list(raw.get("pairs") or []), dict(raw.get("all_peers") or {}),
                   list(raw.get("errors") or []))


def statements(fp: Fingerprint) -> list[str]:
    """Plain sentences about the fabric, the decisive ones first."""
    out: list[str] = []
    staged = []
    for pair in fp.pairs:
        copy = {int(k): float(v) for k, v in (pair.get("copy_us") or {}).items()}
        if len(copy) >= 2:
            g = growth(sorted(copy), [copy[k] for k in sorted(copy)])
            if g["staged"]:
                staged.append((pair, copy, g))
    for pair, copy, g in staged:
        small, large = min(copy), max(copy)
        out.append(f"P2P from cuda:{pair['src']} to cuda:{pair['dst']} is driver-staged: a copy takes "
                   f"{copy[small]:.1f} us at {small} B and {copy[large]:.1f} us at {large} B (about "
                   f"{g['marginal_gbps']:.2f} GB/s per extra byte): the driver moves it through host memory. Our "
                   "device-memory workspace will be slow on this pair; check IOMMU (iommu=pt) and ACS settings, and "
                   "the driver's P2P support for this board")
    ratio, verdict = ratio_verdict(fp.all_peers.get("store_gbps"), fp.all_peers.get("load_gbps"))
    if verdict == "posted-write collapse":
        out.append(f"posted-write collapse: with every GPU writing to all its peers at once, SM stores reach "
                   f"{fp.all_peers['store_gbps']:.1f} GB/s per GPU against {fp.all_peers['load_gbps']:.1f} GB/s for SM "
                   f"loads (ratio {ratio:.2f}): push transports will be slow on this box, pull ones are not affected")
    elif verdict == "stores beat loads":
        out.append(f"with all peers at once SM stores ({fp.all_peers['store_gbps']:.1f} GB/s per GPU) beat SM loads "
                   f"({fp.all_peers['load_gbps']:.1f} GB/s): push transports are favoured here")
    collapsed = [p for p in fp.pairs if ratio_verdict(p.get("store_gbps"), p.get("load_gbps"))[1] ==
                 "posted-write collapse"]
    if collapsed:
        shown = ", ".join(f"{p['src']}->{p['dst']}" for p in collapsed[:12])
        out.append(f"posted-write collapse between single pairs too ({len(collapsed)} of {len(fp.pairs)}: {shown})")
    if not out and fp.pairs:
        out.append("no posted-write collapse and no driver-staged P2P seen")
    return out


def report_lines(fp: Fingerprint) -> list[str]:
    """The doctor's section: one line per pair, the all-peers line, then the statements."""
    lines = []
    for p in fp.pairs:
        ratio, verdict = ratio_verdict(p.get("store_gbps"), p.get("load_gbps"))
        copy = p.get("copy_us") or {}
        copies = ", ".join(f"{int(k)} B {float(v):.1f} us" for k, v in sorted(copy.items(), key=lambda kv: int(kv[0])))
        lines.append(
            f"cuda:{p['src']} -> cuda:{p['dst']}: SM store {_num(p.get('store_gbps'))} GB/s, SM load "
            f"{_num(p.get('load_gbps'))} GB/s (ratio {_num(ratio, 2)}, {verdict}); one-way flag latency "
            f"{_num(p.get('latency_us'), 2)} us; copy {copies or '-'}")
    if fp.all_peers:
        ratio, verdict = ratio_verdict(fp.all_peers.get("store_gbps"), fp.all_peers.get("load_gbps"))
        lines.append(f"all peers at once, per GPU: SM store {_num(fp.all_peers.get('store_gbps'))} GB/s, SM load "
                     f"{_num(fp.all_peers.get('load_gbps'))} GB/s (ratio {_num(ratio, 2)}, {verdict})")
    lines += [f"error: {e}" for e in fp.errors]
    lines += [f"=> {s}" for s in statements(fp)]
    return lines


def _num(value, digits: int = 1) -> str:
    return "?" if value is None else f"{float(value):.{digits}f}"
