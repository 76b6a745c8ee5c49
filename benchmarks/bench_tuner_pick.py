"""Does the quick tune a server runs at its start pick the launch a sweep of every launch finds fastest? One GPU,
the ranks as concurrent workspaces of one process (benchmarks.harness.local_group, each rank on a W-th of the
SMs): the setting the one-process tune measures in, so the tuner and the sweep see the same kernels on the same budget.

    python -m benchmarks.bench_tuner_pick [--out benchmarks/results] [--worlds 2 4 8] [--iters 30] [--calls 20]

Per world W:
1. the tune: the quick tune of a server's start, in one process (benchmarks.harness.local_tune.run_one_process;
   quick, hidden 7168, bf16, rows up to max(ROWS), ROWS among the measured rows). NCCL cannot run in one process; its
   time is set far above ours (debug_nccl_us), so every size routes to one of our launches, by the tuner's own rule
   (its hysteresis included): the pick under test. The table is kept in the JSON (`tables`);
2. the sweep: every launch the kernels take at each of ROWS, plain and fused (`sweep_routes`: schedules x transports
   x CTA caps x the plain CTA sizes x the fused one-shot's clusters x staged push's windows, one launch per distinct
   grid; a superset of the quick tune's candidates, which tests/bench/test_tuner_pick.py checks), each as W
   concurrent graph branches of `calls` calls, the median over `iters` replays;
3. the confirmation: the pick and the CONFIRM_TOP fastest of the sweep, timed again in CONFIRM_ROUNDS rounds, in
   turn, so that one launch's slow replays or the GPU's drift between the sweep and the pick cannot decide; each
   launch's time is the median of its rounds.
`pick_over_best` = the pick's confirmed time / the fastest confirmed time, wanted within PICK_TARGET
(`within_target`). Every call's result is checked (every rank's input holds 1.0, the residual too: the sum is W,
W + 1 fused); a wrong result or a kernel timeout is recorded (`result_correct` false, `error`), is never the best,
and the group is rebuilt before the next launch. Past TIME_LIMIT_S (env BENCH_TUNER_PICK_TIME_LIMIT_S) the sweep
launches not yet timed are left out (`sweep_launches_left_out`); the picks are timed anyway.
Nothing here crosses a link: on a PCIe box the launches rank by what its fabric does, which a tune there measures.
Output: tuner_pick_<gpu>_concurrent.json.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence

from sgl_kernel_sm120.policy import (
    ELEMENT_BYTES,
    ROW_SPLITS,
    STAGED_FEW_CTAS,
    KernelLimits,
    Memory,
    Route,
    Schedule,
    Transport,
    WorkspaceShape,
    cta_cap,
    plain_threads,
    refusal,
)
from sglang_sm120.tuning.candidates import launch_of

HIDDEN = 7168
ROWS = (1, 3, 16)  # bench_transports' swept shapes: a decode step, a verify step, a larger verify step
WORLDS = (2, 4, 8)
KINDS = ("plain", "fused")
DTYPE = "bfloat16"
SWEEP_THREADS = (64, 128, 256, 512)  # the plain kernels' CTA sizes
SWEEP_CTA_DIVISORS = (4, 2, 1)  # CTA caps as the SM budget divided by these
SWEEP_CTA_CAPS = (STAGED_FEW_CTAS, 16, 32)  # and these fixed caps (staged push's few-CTA cap among them)
CONFIRM_TOP = 3
CONFIRM_ROUNDS = 3
PICK_TARGET = 1.05
NCCL_STAND_IN_US = 1.0e6  # the incumbent's injected time: far above any launch of ours, so ours is always routed
TIME_LIMIT_S = float(os.environ.get("BENCH_TUNER_PICK_TIME_LIMIT_S", "300"))


# ---------------------------------------------------------------------------------------------------------
# What is swept, and what counts as the same launch


def sweep_windows(world: int) -> list[int]:
    """Staged push's windows swept: one pass at a time, two, and every pass in flight."""
    return sorted({w for w in (1, 2, world - 1) if 1 <= w <= world - 1})


def sweep_caps(shape: WorkspaceShape) -> list[int]:
    budget = int(shape.sm_budget)
    return sorted({max(1, budget // d) for d in SWEEP_CTA_DIVISORS} | {c for c in SWEEP_CTA_CAPS if c <= budget})


def launch_key(route: Route, kind: str, rows: int, shape: WorkspaceShape, limits: KernelLimits) -> tuple:
    """What the kernels launch for `route` at this size, every default resolved the way the call resolves it
    (IpcAllReduce.launch / launch_fused, policy.plain_grid / fused_grid): two routes with one key are one launch.
    A fused one-shot route without a cluster (the kernels' own rule) keeps "rule": its cluster is decided in C++."""
    nbytes = rows * HIDDEN * ELEMENT_BYTES
    ctas = cta_cap(route, shape)
    window = None
    if route.transport is Transport.STAGED:
        window = min(route.window or shape.world_size - 1, shape.world_size - 1)
    head = (kind, route.schedule.name, route.transport.value)
    if kind == "fused" and route.schedule is Schedule.ONESHOT and route.cluster is None:
        return (*head, "rule", ctas, window)
    threads = (route.threads or plain_threads(nbytes, route.transport, ctas=ctas, limits=limits)
               if kind == "plain" else None)
    return (*head, *launch_of(kind, nbytes, rows, ctas, route.cluster, threads, limits), window)


def sweep_routes(kind: str, rows: int, shape: WorkspaceShape, limits: KernelLimits) -> list[Route]:
    """Every launch the workspace of `shape` runs at `rows` x HIDDEN, one route per distinct launch (launch_key; of
    routes that launch the same grid, the largest CTA cap, as the tuner keeps), each naming its whole launch."""
    nbytes = rows * HIDDEN * ELEMENT_BYTES
    fused = kind == "fused"
    schedules = [Schedule.ONESHOT] + ([Schedule.TWOSHOT] if shape.world_size > 2 else [])
    if shape.num_islands >= 2:
        schedules.append(Schedule.ISLAND)
    transports = list(Transport) if shape.memory is Memory.DEVICE else [Transport.PUSH]
    chosen: dict[tuple, Route] = {}
    for schedule, transport, ctas in itertools.product(schedules, transports, sweep_caps(shape)):
        windows: Sequence[int | None] = sweep_windows(shape.world_size) if transport is Transport.STAGED else [None]
        if fused:
            clusters: Sequence[int | None] = (
                [c for c in ROW_SPLITS if c == 1 or c in shape.clusters] if schedule is Schedule.ONESHOT else [None])
            shapes = [dict(cluster=c) for c in clusters if c is None or c <= ctas]
        else:
            shapes = [dict(threads=t) for t in SWEEP_THREADS if t <= limits.plain_max_threads]
        for launch, window in itertools.product(shapes, windows):
            route = Route(schedule, transport, shape.memory, ctas, window=window, **launch)
            if refusal(shape, route, nbytes, fused=fused, limits=limits) is None:
                chosen[launch_key(route, kind, rows, shape, limits)] = route  # ascending caps: the largest stays
    return list(chosen.values())


# ---------------------------------------------------------------------------------------------------------
# The verdict


def rate(timed: Sequence[dict], pick: str, confirmed: dict[str, list[float]]) -> dict:
    """The verdict at one size. `timed`: the sweep's records ({"route", "us", "result_correct"}); `pick`: the
    tuner's route id; `confirmed`: per route id its confirmation rounds (us). The best is the fastest correct
    launch by its confirmed median; a pick that is missing, wrong or unconfirmed is not within the target."""
    correct = {r["route"] for r in timed if r["result_correct"]}
    medians = {rid: statistics.median(us) for rid, us in confirmed.items() if us and rid in correct}
    best = min(medians, key=lambda rid: (medians[rid], rid)) if medians else None
    pick_us = medians.get(pick)
    ratio = pick_us / medians[best] if pick_us is not None and best is not None else None
    return {"pick": pick, "pick_us": pick_us, "best": best, "best_us": medians.get(best) if best else None,
            "pick_over_best": ratio, "within_target": ratio is not None and ratio <= PICK_TARGET,
            "confirmed_us": {rid: medians.get(rid) for rid in confirmed}}


def confirmation_set(timed: Sequence[dict], pick: str, top: int = CONFIRM_TOP) -> list[str]:
    """The pick and the `top` fastest correct launches of the sweep, each once, the pick first."""
    ranked = sorted((r for r in timed if r["result_correct"] and r["us"] is not None), key=lambda r: r["us"])
    out = [pick]
    for r in ranked:
        if len(out) > top:
            break
        if r["route"] not in out:
            out.append(r["route"])
    return out


# ---------------------------------------------------------------------------------------------------------
# On the GPU


@dataclasses.dataclass
class Group:
    """A one-process group of `world` ranks and one stream per rank; rebuilt after a failed launch (a timeout
    poisons its workspaces)."""

    device: object
    world: int
    comms: list | None = None
    streams: list | None = None

    def open(self) -> list:
        import torch

        from benchmarks.harness.local_group import local_group

        if self.comms is None:
            self.comms = local_group(self.device, self.world, max(ROWS) * HIDDEN, torch.bfloat16, link="auto",
                                     timeout_s=10.0, on_timeout="exit")
            self.streams = [torch.cuda.Stream() for _ in range(self.world)]
        return self.comms

    def close(self) -> None:
        from benchmarks.harness.local_group import close_local_group

        comms, self.comms = self.comms, None
        if comms is not None:
            close_local_group(comms)


def time_route(group: Group, route: Route, kind: str, rows: int, calls: int, iters: int, warmup: int) -> dict:
    """One launch timed as the group's W concurrent graph branches: {"us", "result_correct", "error"}."""
    import torch

    from benchmarks.harness import concurrent, timing

    comms = group.open()
    dev = comms[0].device
    xs = [torch.ones(rows, HIDDEN, dtype=torch.bfloat16, device=dev) for _ in range(group.world)]
    res = torch.ones_like(xs[0])
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)
    outs: list = [None] * group.world

    def call(r: int) -> None:
        if kind == "plain":
            outs[r] = comms[r].all_reduce(xs[r], route=route)
        else:
            outs[r] = comms[r].all_reduce_add_rmsnorm(xs[r], res, weight, 1e-6, route=route)[1]

    try:
        graph = concurrent.capture_concurrent(group.streams, call, calls)
        per_call = [v / calls for v in timing.replay_times(graph, iters, warmup=warmup)]
        del graph
        expected = torch.full_like(xs[0], group.world + (kind == "fused"))
        timeouts = [str(c.timeout_error()) for c in comms if c.timeout_error() is not None]
        correct = not timeouts and all(torch.equal(o, expected) for o in outs)
        error = "; ".join(timeouts) or (None if correct else "wrong result")
        us = statistics.median(per_call)
    except Exception as exc:  # noqa: BLE001 - recorded; the group is rebuilt
        correct, error, us = False, f"{type(exc).__name__}: {exc}"[:400], None
    if not correct:
        group.close()
    return {"us": us, "result_correct": correct, "error": error}


def tune_picks(world: int, device_index: int) -> tuple[dict, dict[tuple[str, int], Route | None], float]:
    """The quick tune in one process: (its table as a dict, the route it sends each (kind, rows) of ROWS to, its
    seconds)."""
    from benchmarks.harness.local_tune import run_one_process
    from sglang_sm120.routing.table import lookup
    from sglang_sm120.tuning.tuner import TuneSpec

    spec = TuneSpec.make(HIDDEN, max(ROWS), quick=True, dtypes=[DTYPE], kinds=list(KINDS), graph_rows=list(ROWS),
                         debug_nccl_us=NCCL_STAND_IN_US)
    began = time.monotonic()
    table, _ = run_one_process(world, device_index, spec)
    seconds = time.monotonic() - began
    picks = {(kind, rows): lookup(table, rows * HIDDEN * ELEMENT_BYTES, DTYPE, kind == "fused")
             for kind, rows in itertools.product(KINDS, ROWS)}
    return table.to_dict(), picks, seconds


def _sweep_world(world: int, dev, args, deadline: float, log: Callable[[str], None]) -> tuple[list, list, dict, int]:
    table, picks, tune_s = tune_picks(world, dev.index)
    log(f"W={world}: quick tune in {tune_s:.1f} s")
    group = Group(dev, world)
    records, verdicts, left_out = [], [], 0
    try:
        comms = group.open()
        shape, limits = comms[0].shape, comms[0].limits
        for kind, rows in itertools.product(KINDS, ROWS):
            pick = picks[(kind, rows)]
            pick_id = pick.id if pick is not None else "nccl"
            timed = []
            for route in sweep_routes(kind, rows, shape, limits):
                if time.monotonic() > deadline:
                    left_out += 1
                    continue
                rec = {"world": world, "kind": kind, "rows": rows, "route": route.id,
                       **time_route(group, route, kind, rows, args.calls, args.iters, args.warmup)}
                timed.append(rec)
                log(f"W={world} {kind:5s} [{rows:2d},{HIDDEN}] {route.id:40s} "
                    + (f"{rec['us']:7.2f} us" if rec["us"] is not None else "   -   ")
                    + ("" if rec["result_correct"] else f"  FAILED: {rec['error']}"))
            if pick is not None and pick_id not in {r["route"] for r in timed}:
                timed.append({"world": world, "kind": kind, "rows": rows, "route": pick_id,
                              **time_route(group, pick, kind, rows, args.calls, args.iters, args.warmup)})
            confirmed: dict[str, list[float]] = {rid: [] for rid in confirmation_set(timed, pick_id)}
            routes = {rid: Route.parse(rid) for rid in confirmed if rid != "nccl"}
            for _ in range(CONFIRM_ROUNDS):
                for rid, route in routes.items():
                    again = time_route(group, route, kind, rows, args.calls, args.iters, args.warmup)
                    if again["result_correct"]:
                        confirmed[rid].append(again["us"])
            shape_key = launch_key(pick, kind, rows, shape, limits) if pick is not None else None
            verdict = {"world": world, "kind": kind, "rows": rows, "launches_swept": len(timed),
                       "pick_same_launch_as": sorted(r["route"] for r in timed if pick is not None
                                                     and launch_key(Route.parse(r["route"]), kind, rows, shape,
                                                                    limits) == shape_key),
                       **rate(timed, pick_id, confirmed)}
            verdicts.append(verdict)
            ratio = verdict["pick_over_best"]
            log(f"W={world} {kind} rows {rows}: pick {pick_id} against best {verdict['best']}: "
                + (f"{ratio:.3f}x" if ratio is not None else "-")
                + ("" if verdict["within_target"] else f"  OFF THE TARGET {PICK_TARGET}x"))
            records += timed
        workspace = {"shape": shape.as_dict(), "limits": limits.as_dict()}
    finally:
        group.close()
    return records, verdicts, {"table": table, "tune_s": tune_s, **workspace}, left_out


def run(args) -> dict:
    import torch

    from benchmarks.harness import microbench

    dev = torch.device("cuda", torch.cuda.current_device())
    began = time.monotonic()
    deadline = began + TIME_LIMIT_S
    records, verdicts, tables, left_out = [], [], {}, 0
    for world in args.worlds:
        r, v, t, n = _sweep_world(world, dev, args, deadline, lambda line: print(line, flush=True))
        records += r
        verdicts += v
        tables[str(world)] = t
        left_out += n
    missed = [v for v in verdicts if not v["within_target"]]
    print(f"{len(verdicts) - len(missed)} of {len(verdicts)} sizes within {PICK_TARGET}x; total "
          f"{time.monotonic() - began:.1f} s" + (f"; {left_out} sweep launches left out" if left_out else ""))
    return microbench.document(
        "bench_tuner_pick", __doc__, "one-process concurrent groups", args, {}, records, summary=verdicts,
        statistic=("a launch's time: the median over the timed replays of (replay time / calls per replay), a "
                   "replay ending when the slowest rank's branch has; a confirmed time (pick, best): the median "
                   f"of {CONFIRM_ROUNDS} such medians, each round captured again"),
        tables=tables, sweep_launches_left_out=left_out, pick_target=PICK_TARGET,
        seconds=time.monotonic() - began,
        note="one GPU: no link is crossed; each rank gets a W-th of the SMs; NCCL's time injected (not run)",
    )


def _options(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="group sizes to run")


def main(argv=None) -> int:
    from benchmarks.harness import microbench

    return microbench.main(run, "tuner_pick", __doc__, argv, iters=30, calls=20, mode="concurrent",
                           options=_options)


if __name__ == "__main__":
    raise SystemExit(main())
