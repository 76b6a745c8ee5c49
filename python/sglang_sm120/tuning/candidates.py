"""Which launches of our kernels the tuner times at a size (NCCL, the incumbent, is always timed besides).

`candidates()` is a pure function of group-identical inputs (the agreed WorkspaceShape and KernelLimits, the size,
the kind), so every rank times the same candidates in the same order: a rank with another list would wait in a
collective its peers never enter. Every candidate is a route the workspace runs as it is (policy.refusal), so what
was timed is what a server runs. TWOSHOT only from 4 ranks: at 2 it moves one-shot's bytes in twice the hops. Host
memory pushes only: every byte goes through the shared host buffer, so pacing and peer loads gain nothing. The plain
kernels' CTA size is tuned on the whole budget: a fixed one was up to 1.24x off the best (bench_tuner_pick.py). The
fused one-shot's clusters only where rows x cluster <= CTAs: past that the split loses. Shapes that launch the same
grid are timed once, at the largest cap (the kernels' own default).
"""

from __future__ import annotations

from sgl_kernel_sm120 import policy
from sgl_kernel_sm120.policy import KernelLimits, Route, Schedule, Transport, WorkspaceShape

# CTA caps as fractions of the SM budget; the plain kernels' CTA sizes on the whole budget (quick: the seed's multiples)
QUICK_CTA_FRACTIONS = (2, 1)
FULL_CTA_FRACTIONS = (4, 2, 1)
QUICK_THREAD_STEPS = (1, 2, 4)
FULL_THREAD_SIZES = (64, 128, 256, 512)


def cta_caps(transport: Transport, shape: WorkspaceShape, quick: bool) -> list[int]:
    """The CTA caps tried for `transport`, ascending; [] when the SM budget is not known."""
    budget = int(shape.sm_budget)
    if budget < 1:
        return []
    if transport is not Transport.STAGED:
        return sorted({max(1, budget // f) for f in (QUICK_CTA_FRACTIONS if quick else FULL_CTA_FRACTIONS)})
    cap = max(1, min(policy.STAGED_FEW_CTAS, budget))
    more = () if quick else (cap * 2, cap * 4, budget // 2)
    return sorted({cap, budget} | {c for c in more if cap < c < budget})


def thread_sizes(nbytes: int, transport: Transport, ctas: int, limits: KernelLimits, quick: bool) -> list[int]:
    """The plain kernels' CTA sizes tried under a cap of `ctas` (the whole budget), ascending, the seed always
    (staged push: only the seed in a quick tune)."""
    seed = policy.plain_threads(nbytes, transport, ctas=ctas, limits=limits)
    if quick:
        sizes = {seed} if transport is Transport.STAGED else {seed * step for step in QUICK_THREAD_STEPS}
    else:
        sizes = {seed, *FULL_THREAD_SIZES}
    return sorted(t for t in sizes if t <= limits.plain_max_threads)


def launch_of(kind: str, nbytes: int, rows: int, ctas: int, cluster: int | None, threads: int | None,
              limits: KernelLimits) -> tuple[int, int, int]:
    """(CTAs per row, grid, CTA size) the kernels launch for these fields at this size (policy.plain_grid's clamp
    of the CTA size; fused: 0, the kernels size their own): two launches with one triple run the same grid."""
    if kind == "plain":
        packs = max(1, nbytes // limits.pack_bytes)
        return 1, policy.plain_grid(nbytes, ctas, threads, limits), min(
            threads, limits.plain_max_threads, -(-packs // policy.THREAD_GRAIN) * policy.THREAD_GRAIN)
    return cluster or 1, policy.fused_grid(rows, ctas, cluster or 1), 0


def launch_shapes(kind: str, schedule: Schedule, transport: Transport, nbytes: int, rows: int, shape: WorkspaceShape,
                  limits: KernelLimits, quick: bool) -> list[tuple[int | None, int | None, int | None]]:
    """(CTA cap, cluster, threads) of every distinct launch of one schedule and transport timed at this size; cap and
    threads None (the kernels' own) where the SM budget is not known; threads for plain calls only."""
    caps = cta_caps(transport, shape, quick)
    fused_oneshot = kind == "fused" and schedule is Schedule.ONESHOT
    clusters = [c for c in policy.ROW_SPLITS if c == 1 or c in shape.clusters] if fused_oneshot else [None]
    if not caps:
        return [(None, c, None) for c in clusters]
    chosen: dict[tuple[int, int, int], tuple[int, int | None, int | None]] = {}
    for cluster in clusters:
        for cap in caps:
            if (cluster or 1) > 1 and rows * cluster > cap:
                continue
            sizes: list[int | None] = [None]
            if kind == "plain":  # the seed size below the budget, every one of thread_sizes on it
                sizes = (thread_sizes(nbytes, transport, cap, limits, quick) if cap == caps[-1]
                         else [policy.plain_threads(nbytes, transport, ctas=cap, limits=limits)])
            for threads in sizes:  # ascending caps: the largest of a launch stays
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
                  or nbytes % (policy.ELEMENT_BYTES * hidden)):
        return []
    rows = nbytes // (policy.ELEMENT_BYTES * hidden) if hidden > 0 else 0
    device = shape.memory is policy.Memory.DEVICE
    schedules = [s for s, wanted in ((Schedule.ONESHOT, True), (Schedule.TWOSHOT, shape.world_size > 2),
                                     (Schedule.ISLAND, shape.num_islands >= 2 and device)) if wanted]
    last = max(1, shape.world_size - 1)  # staged push's passes in flight before the pacing waits: 1, all, 2 (full)
    staged_windows = sorted({1, last} | (set() if quick else {min(2, last)}))
    routes: list[Route] = []
    for schedule in schedules:
        for transport in list(Transport) if device else [Transport.PUSH]:
            windows = staged_windows if transport is Transport.STAGED else [None]
            for ctas, cluster, threads in launch_shapes(kind, schedule, transport, nbytes, rows, shape, limits, quick):
                for window in windows:
                    route = Route(schedule, transport, shape.memory, ctas, cluster, threads, window)
                    if policy.refusal(shape, route, nbytes, fused=fused, limits=limits) is None:
                        routes.append(route)
    return routes
