"""The P2P fingerprints of a PCIe box, measured and judged (a developer's diagnostic, not run by the product):

    python scripts/p2p_fingerprint.py [--gpus 0,1,...] [--mib 64] [--json]

What it measures, with torch and Triton only (none of the project's kernels):
- SM store bandwidth src -> dst (a Triton copy kernel on src writing dst's memory through peer access) and SM
  load bandwidth (the same kernel reading dst's memory), per ordered pair and every GPU to all peers at once;
  a store/load ratio far below 1 is posted-write collapse (push transports suffer, pull ones do not);
- one-way flag latency per pair (a store to the peer's flag, the peer spinning on its own memory, halved);
- copy time against size per pair (the copy engine), whose growth at host-staging speed is driver-staged P2P.
A Triton without `inline_asm_elementwise` or volatile loads skips the latency (reported as an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
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




COPY_SIZES = (4096, 16384, 65536, 262144)
PINGPONG_ITERS = 200
MAX_SPINS = 2_000_000  # per wait (about a second): the kernels end on their own if a peer never answers
BLOCK = 4096


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    @triton.jit
    def pingpong_kernel(my_flag, peer_flag, out, iters, max_spins, FIRST: tl.constexpr):
        start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        timeouts = 0
        for i in range(1, iters + 1):
            if FIRST:
                tl.store(peer_flag, i)
            seen = tl.load(my_flag, volatile=True)
            spins = 0
            limit = tl.where(timeouts == 0, max_spins, 0)  # after one wait gave up, the rest do not wait
            while (seen < i) & (spins < limit):
                seen = tl.load(my_flag, volatile=True)
                spins += 1
            timeouts += (seen < i).to(tl.int32)
            if not FIRST:
                tl.store(peer_flag, i)
        end = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        tl.store(out, end - start)
        tl.store(out + 1, timeouts.to(tl.int64))

    return copy_kernel, pingpong_kernel


def _enable_peer_access(devices) -> None:
    """torch enables peer access from a copy's source device to its destination on its first copy between them;
    one tiny copy per ordered pair lets the Triton kernels address the peers' memory."""
    import torch

    for i in devices:
        for j in devices:
            if i != j:
                torch.ones(1, device=f"cuda:{j}").copy_(torch.ones(1, device=f"cuda:{i}"))
    for d in devices:
        torch.cuda.synchronize(d)


def _copy_gbps(copy_kernel, src, dst, runner: int, reps: int = 5) -> float:
    """Bandwidth of `copy_kernel` run on GPU `runner` from src to dst (either may be a peer's), median of reps."""
    import torch

    n = src.numel()
    grid = (triton_cdiv(n, BLOCK),)
    times = []
    with torch.cuda.device(runner):
        copy_kernel[grid](src, dst, n, BLOCK=BLOCK)  # compile + warm
        torch.cuda.synchronize(runner)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            copy_kernel[grid](src, dst, n, BLOCK=BLOCK)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    return n * src.element_size() / statistics.median(times) / 1e9


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _all_peers_gbps(copy_kernel, bufs, devices, store: bool) -> float:
    """Every GPU copies to (store) or from (load) every peer at once; per-GPU bandwidth."""
    import torch

    n = bufs[devices[0]]["a"].numel()
    grid = (triton_cdiv(n, BLOCK),)
    streams = {(i, j): torch.cuda.Stream(device=i) for i in devices for j in devices if i != j}
    for d in devices:
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for (i, j), stream in streams.items():
        with torch.cuda.device(i), torch.cuda.stream(stream):
            src, dst = (bufs[i]["a"], bufs[j]["peer_in"][i]) if store else (bufs[j]["a"], bufs[i]["peer_in"][j])
            copy_kernel[grid](src, dst, n, BLOCK=BLOCK)
    for d in devices:
        torch.cuda.synchronize(d)
    seconds = time.perf_counter() - start
    return (len(devices) - 1) * n * 4 / seconds / 1e9


def _latency_us(pingpong_kernel, i: int, j: int) -> float:
    import torch

    flags = {d: torch.zeros(1, dtype=torch.int32, device=f"cuda:{d}") for d in (i, j)}
    outs = {d: torch.zeros(2, dtype=torch.int64, device=f"cuda:{d}") for d in (i, j)}
    with torch.cuda.device(j):  # the answering side first, so it is spinning when the first flag lands
        pingpong_kernel[(1,)](flags[j], flags[i], outs[j], PINGPONG_ITERS, MAX_SPINS, FIRST=False)
    with torch.cuda.device(i):
        pingpong_kernel[(1,)](flags[i], flags[j], outs[i], PINGPONG_ITERS, MAX_SPINS, FIRST=True)
    torch.cuda.synchronize(i)
    torch.cuda.synchronize(j)
    elapsed_ns, timeouts = (int(v) for v in outs[i].tolist())
    if timeouts:
        raise RuntimeError(f"{timeouts} of {PINGPONG_ITERS} flag waits from cuda:{i} to cuda:{j} gave up")
    return elapsed_ns / 1e3 / PINGPONG_ITERS / 2


def _copy_times_us(src_device: int, dst_device: int, reps: int = 20) -> dict[int, float]:
    import torch

    out = {}
    for size in COPY_SIZES:
        src = torch.ones(size // 4, device=f"cuda:{src_device}")
        dst = torch.empty(size // 4, device=f"cuda:{dst_device}")
        with torch.cuda.device(src_device):
            dst.copy_(src)
            torch.cuda.synchronize(src_device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                dst.copy_(src)
            b.record()
            b.synchronize()
        out[size] = a.elapsed_time(b) * 1e3 / reps
    return out


def measure(devices: list[int], mib: int = 64) -> dict[str, Any]:
    import torch

    errors: list[str] = []
    copy_kernel, pingpong_kernel = _kernels()
    _enable_peer_access(devices)
    n = mib * (1 << 20) // 4
    bufs = {d: {"a": torch.ones(n, device=f"cuda:{d}"),
                "peer_in": {s: torch.empty(n, device=f"cuda:{d}") for s in devices if s != d}} for d in devices}
    pairs = []
    for i in devices:
        for j in devices:
            if i == j:
                continue
            pair: dict[str, Any] = {"src": i, "dst": j}
            try:
                pair["store_gbps"] = _copy_gbps(copy_kernel, bufs[i]["a"], bufs[j]["peer_in"][i], runner=i)
                pair["load_gbps"] = _copy_gbps(copy_kernel, bufs[j]["a"], bufs[i]["peer_in"][j], runner=i)
            except Exception as exc:  # noqa: BLE001 - reported, the rest still measured
                errors.append(f"bandwidth {i}->{j}: {type(exc).__name__}: {exc}")
            try:
                pair["latency_us"] = _latency_us(pingpong_kernel, i, j)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"latency {i}->{j}: {type(exc).__name__}: {exc}")
            try:
                pair["copy_us"] = _copy_times_us(i, j)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"copy {i}->{j}: {type(exc).__name__}: {exc}")
            pairs.append(pair)
    all_peers: dict[str, Any] = {}
    try:
        all_peers = {"store_gbps": _all_peers_gbps(copy_kernel, bufs, devices, store=True),
                     "load_gbps": _all_peers_gbps(copy_kernel, bufs, devices, store=False)}
    except Exception as exc:  # noqa: BLE001
        errors.append(f"all peers: {type(exc).__name__}: {exc}")
    return {"gpus": devices, "pairs": pairs, "all_peers": all_peers, "errors": errors}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/p2p_fingerprint.py")
    parser.add_argument("--gpus", default=None, help="comma list of CUDA device indices (default: all)")
    parser.add_argument("--mib", type=int, default=64, help="MiB per bandwidth copy")
    parser.add_argument("--json", action="store_true", help="print the measurements as one JSON object")
    args = parser.parse_args(argv)
    import torch

    devices = ([int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count())))
    if len(devices) < 2:
        print(json.dumps({"gpus": devices, "pairs": [], "all_peers": {}, "errors": ["fewer than 2 GPUs"]}))
        return 0
    found = measure(devices, args.mib)
    if args.json:
        print(json.dumps(found), flush=True)
    else:
        print("\n".join(report_lines(Fingerprint.from_dict(found))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
