"""Which launches of our kernels the tuner times at a size.

`candidates()` is a pure function of group-identical inputs (the workspace's agreed `WorkspaceShape`, its
library's `KernelLimits`, the size, the kind), so every rank times the same candidates in the same order; a rank
that timed another list would wait in a collective its peers never enter. The launches themselves, and what a
workspace runs, are sgl_kernel_sm120.policy's; this module only picks which of them are worth a measurement:
- ONESHOT always (host memory: up to the workspace's one-shot bound); TWOSHOT from 4 ranks on (at 2 it moves the
  same bytes as one-shot in twice the hops); ISLAND when the workspace has two or more islands (device memory);
- device memory: every transport; host memory: push only (every byte goes through the shared host buffer, where
  the staged pacing and the peer loads have nothing to gain);
- the launch shape of each, in the quick tune too (`launch_shapes`): a few CTA caps up to the group's SM budget
  (staged push: from its few-CTA cap STAGED_FEW_CTAS up to the budget); for the plain kernels their CTA size
  (`thread_sizes`: on the whole budget, the seed size and two and four times it in the quick tune, 64 to 512 in a
  full one; staged push at its seed size in the quick tune; the seed is policy.plain_threads under that cap), as
  the one-GPU sweep of every launch found a fixed CTA size up to 1.24x off the best at some sizes
  (benchmarks/bench_tuner_pick.py, 1x H200, 2026-12-03); and for the fused one-shot every cluster size
  the workspace agreed (1 always; 2, 4, 8 where the cluster check passed) whose clusters all fit the CTAs at
  once (rows x cluster <= CTAs: past that rows loop and the split loses, csrc/ar_kernels.cu
  fused_cluster_size). Shapes that launch the same grid at this size are timed once (policy.plain_grid,
  policy.fused_grid: the kernels clamp the grid to the work, so at few rows most caps are the same launch), and
  the route keeps the largest cap of them (the kernels' own default);
- staged push's window (its passes in flight before their pacing waits, `staged_windows`): one pass at a time and
  all of them (W - 1) in the quick tune, and 2 between in a full one; at 2 ranks there is one pass;
- NCCL is not a candidate of ours: the tuner always times it, as the incumbent.
Every candidate is a route the workspace runs as it is (policy.refusal), so what was timed is what a server runs.
"""

from __future__ import annotations

from sgl_kernel_sm120.policy import (
    ELEMENT_BYTES,
    ROW_SPLITS,
    STAGED_FEW_CTAS,
    THREAD_GRAIN,
    KernelLimits,
    Memory,
    Route,
    Transport,
    Variant,
    WorkspaceShape,
    fused_grid,
    plain_grid,
    plain_threads,
    refusal,
)

# The CTA caps tried, as fractions of the SM budget (the budget itself always; staged push from its own cap up).
QUICK_CTA_FRACTIONS = (2, 1)  # budget / 2, budget
FULL_CTA_FRACTIONS = (4, 2, 1)
# The plain kernels' CTA sizes tried on the whole budget: the seed size times these in the quick tune, every one of
# FULL_THREAD_SIZES in a full one (each up to the kernels' largest).
QUICK_THREAD_STEPS = (1, 2, 4)
FULL_THREAD_SIZES = (64, 128, 256, 512)


def cta_caps(transport: Transport, shape: WorkspaceShape, quick: bool) -> list[int]:
    """The CTA caps tried for `transport`, ascending; [] when the SM budget is not known."""
    budget = int(shape.sm_budget)
    if budget < 1:
        return []
    caps = {max(1, budget // f) for f in (QUICK_CTA_FRACTIONS if quick else FULL_CTA_FRACTIONS)}
    if transport is Transport.STAGED:
        cap = max(1, min(STAGED_FEW_CTAS, budget))
        caps = {cap, budget}
        if not quick:
            caps |= {c for c in (cap * 2, cap * 4, budget // 2) if cap < c < budget}
    return sorted(caps)


def staged_windows(world_size: int, quick: bool) -> list[int]:
    """The windows staged push is timed at, ascending: 1 .. world - 1 passes in flight."""
    last = max(1, world_size - 1)
    return sorted({1, last} | (set() if quick else {min(2, last)}))


def thread_sizes(nbytes: int, transport: Transport, ctas: int, limits: KernelLimits, quick: bool) -> list[int]:
    """The plain kernels' CTA sizes tried under a cap of `ctas` (the whole budget), ascending (the seed always)."""
    seed = plain_threads(nbytes, transport, ctas=ctas, limits=limits)
    if quick:
        sizes = {seed} if transport is Transport.STAGED else {seed * step for step in QUICK_THREAD_STEPS}
    else:
        sizes = {seed, *FULL_THREAD_SIZES}
    return sorted(t for t in sizes if t <= limits.plain_max_threads)


def effective_threads(nbytes: int, threads: int, limits: KernelLimits) -> int:
    """The CTA size a plain call of `nbytes` really launches with `threads` asked (policy.plain_grid's clamp)."""
    packs = max(1, nbytes // limits.pack_bytes)
    return min(threads, limits.plain_max_threads, -(-packs // THREAD_GRAIN) * THREAD_GRAIN)


def launch_of(kind: str, nbytes: int, rows: int, ctas: int, cluster: int | None, threads: int | None,
              limits: KernelLimits) -> tuple[int, int, int]:
    """(CTAs per row, grid, CTA size) the kernels launch for these launch fields at this size: two launches with
    the same triple run the same grid (plain: `threads` given, fused: CTA size 0, the kernels size their own)."""
    if kind == "plain":
        return 1, plain_grid(nbytes, ctas, threads, limits), effective_threads(nbytes, threads, limits)
    return cluster or 1, fused_grid(rows, ctas, cluster or 1), 0


def launch_shapes(kind: str, variant: Variant, transport: Transport, nbytes: int, rows: int, shape: WorkspaceShape,
                  limits: KernelLimits, quick: bool) -> list[tuple[int | None, int | None, int | None]]:
    """(CTA cap, cluster, threads) of every launch of one variant and transport timed at this size, each a distinct
    launch (grid and CTA size). (None, cluster, None): the kernels' own cap and CTA size, where the SM budget is not
    known. threads: plain calls only; the seed size at caps below the budget, every one of thread_sizes on it."""
    caps = cta_caps(transport, shape, quick)
    fused_oneshot = kind == "fused" and variant is Variant.ONESHOT
    clusters: list[int | None] = [None]
    if fused_oneshot:
        clusters = [c for c in ROW_SPLITS if c == 1 or c in shape.clusters]
    if not caps:
        return [(None, c, None) for c in clusters]
    chosen: dict[tuple[int, int, int], tuple[int, int | None, int | None]] = {}
    for cluster in clusters:
        for cap in caps:
            if cluster is not None and cluster > 1 and rows * cluster > cap:
                continue
            sizes: list[int | None] = [None]
            if kind == "plain":
                sizes = (thread_sizes(nbytes, transport, cap, limits, quick) if cap == caps[-1]
                         else [plain_threads(nbytes, transport, ctas=cap, limits=limits)])
            for threads in sizes:
                # ascending caps: the largest of a launch stays
                chosen[launch_of(kind, nbytes, rows, cap, cluster, threads, limits)] = (cap, cluster, threads)
    return list(chosen.values())


def candidates(kind: str, nbytes: int, hidden: int, shape: WorkspaceShape, limits: KernelLimits,
               quick: bool) -> list[Route]:
    """Our routes to time at this size, in a fixed order."""
    if kind not in ("plain", "fused"):
        raise ValueError(f"kind must be plain or fused, got {kind!r}")
    if nbytes <= 0 or nbytes % limits.pack_bytes:
        return []
    fused = kind == "fused"
    if fused and (hidden % limits.elems_per_pack or hidden > limits.max_fused_hidden
                  or nbytes % (ELEMENT_BYTES * hidden)):
        return []
    rows = nbytes // (ELEMENT_BYTES * hidden) if hidden > 0 else 0
    variants = [Variant.ONESHOT]
    if shape.world_size > 2:
        variants.append(Variant.TWOSHOT)
    if shape.num_islands >= 2 and shape.memory is Memory.DEVICE:
        variants.append(Variant.ISLAND)
    transports = list(Transport) if shape.memory is Memory.DEVICE else [Transport.PUSH]
    routes: list[Route] = []
    for variant in variants:
        for transport in transports:
            windows = staged_windows(shape.world_size, quick) if transport is Transport.STAGED else [None]
            for ctas, cluster, threads in launch_shapes(kind, variant, transport, nbytes, rows, shape, limits, quick):
                for window in windows:
                    route = Route(variant, transport, shape.memory, ctas, cluster, threads, window)
                    if refusal(shape, route, nbytes, fused=fused, limits=limits) is None:
                        routes.append(route)
    return routes
