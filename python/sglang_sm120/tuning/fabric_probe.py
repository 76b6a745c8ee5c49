"""Measuring the P2P fingerprints (tuning/fabric.py says what they mean), in one process over all visible GPUs:

    python -m sglang_sm120.tuning.fabric_probe [--gpus 0,1,...] [--mib 64]     # prints one JSON object

NOT YET RUN ON A GPU. The doctor runs it as a child process with a time bound (a fault here, on a fabric
nobody measured, must not take the doctor down), and prints "not measured" with the reason if it fails.

What it measures, with torch and Triton only (no kernel of this project's library, which the lead is changing):
- SM store bandwidth src -> dst: a Triton copy kernel on the src GPU reading its own memory and writing the dst
  GPU's (through CUDA peer access, which a torch copy between the two enables); SM load bandwidth: the same
  kernel on the src GPU reading the dst GPU's memory into its own. Per ordered pair, then every GPU to/from all
  its peers at once (one stream per peer, all launched before any is waited for);
- one-way flag latency per pair: two Triton kernels, one per GPU, each storing a counter into the other's flag
  and spinning (volatile loads, bounded) on its own; the round trips are timed with %globaltimer and halved;
- copy time against size per pair (CUDA events around torch copies between the GPUs: the copy engine), whose
  growth tells driver-staged P2P.
A Triton version without `inline_asm_elementwise` or `volatile` loads skips the latency (reported as an error).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

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
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.tuning.fabric_probe")
    parser.add_argument("--gpus", default=None, help="comma list of CUDA device indices (default: all)")
    parser.add_argument("--mib", type=int, default=64, help="MiB per bandwidth copy")
    args = parser.parse_args(argv)
    import torch

    devices = ([int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count())))
    if len(devices) < 2:
        print(json.dumps({"gpus": devices, "pairs": [], "all_peers": {}, "errors": ["fewer than 2 GPUs"]}))
        return 0
    print(json.dumps(measure(devices, args.mib)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
