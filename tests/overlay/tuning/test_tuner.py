"""The tuner's control flow on CPU: ranks as threads (agreeing over an in-memory c10d store) or as gloo processes,
a fake measurer with injected times and failures."""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import socket
import threading

import pytest
import torch.distributed as dist

from sgl_kernel_sm120.policy import WorkspaceShape, kernel_limits
from sglang_sm120.core import exchange
from sglang_sm120.routing import table as tbl
from sglang_sm120.tuning.tuner import TuneError, Tuner, TuneSpec, reduce_verdicts, rows_ladder

# The fake workspace is in host memory, where push is the one transport timed, and its one-shot slots hold every
# size: one candidate per variant.
ONE, TWO = "sm120/ONESHOT/push/host", "sm120/TWOSHOT/push/host"
KEY = {"world_size": 2, "gpus": [{"uuid": "GPU-0"}, {"uuid": "GPU-1"}], "memory": "device"}


class FakeMeasurer:
    """times(cid, kind, dtype, rows, rank) -> us; failures {(cid, rows): (ranks, why)} fail verification there."""

    def __init__(self, rank, times, failures=None, world=2, digests=None):
        self.rank, self.times, self.failures = rank, times, failures or {}
        self.world, self.digests = world, digests or {}
        self.resets, self.verified, self.timed = 0, [], []

    def shape(self):
        return WorkspaceShape(self.world, "host", "host")

    def limits(self):
        return kernel_limits()

    def incumbent(self, kind):
        return "fake NCCL" if kind == "plain" else "fake NCCL + norm"

    def trial(self, route, kind, dtype, rows, profile):
        cid = tbl.route_id(route)
        if route is not None:
            self.verified.append((cid, rows))
            ranks, why = self.failures.get((cid, rows), ((), ""))
            if self.rank in ranks:
                raise AssertionError(why)
        if route is None or profile:
            self.timed.append((cid, rows))
        digest = None if route is None else self.digests.get((cid, rows, self.rank), "same bits")
        return digest, [self.times(cid, kind, dtype, rows, self.rank)] * (3 if profile else 2)

    def reset(self):
        self.resets += 1


def thread_gathers(world):
    store, name = dist.HashStore(), f"tune-test-{next(_groups)}"

    def for_rank(rank):
        counter = itertools.count()

        def gather(obj):
            return exchange.exchange(store, f"{name}/{next(counter)}", rank, world, obj, 10.0)

        return gather

    return for_rank


_groups = itertools.count()


def run_threads(world, make_measurer, spec, progress=None):
    gathers = thread_gathers(world)
    results, errors, measurers = {}, {}, {}

    def body(rank):
        try:
            measurers[rank] = make_measurer(rank)
            tuner = Tuner(measurers[rank], spec, rank=rank, world=world, gather=gathers(rank), key=KEY,
                          progress=(lambda e, r=rank: progress(r, e)) if progress else None)
            results[rank] = tuner.run()
        except Exception as exc:  # surfaced below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results, errors, measurers


def spec(**kw):
    base = dict(hidden=7168, max_rows=4, dtypes=["bfloat16"], kinds=["plain"], quick=False)
    return TuneSpec(**{**base, **kw})


def crossover_times(cid, kind, dtype, rows, rank):
    """ONESHOT halves NCCL up to 2 rows and loses from 3 rows on; TWOSHOT is always worse."""
    nccl = 20.0
    return {"nccl": nccl, ONE: 10.0 if rows <= 2 else 30.0, TWO: 25.0}[cid]


def test_every_rank_builds_the_same_table_from_the_measurements():
    results, errors, _ = run_threads(2, lambda r: FakeMeasurer(r, crossover_times, world=2), spec())
    assert not errors, errors
    assert results[0].digest() == results[1].digest()
    table = results[0]
    assert tbl.describe(table, "bfloat16", "plain") == "ONESHOT/push/host up to 28672 B, NCCL up to 57344 B"
    assert [p.times for p in table.measurements[("bfloat16", "plain")]][0] == {"nccl": 20.0, ONE: 10.0}
    assert table.incumbents == {"plain": "fake NCCL"} and table.workload["rows"] == [1, 2, 3, 4]


def test_the_slowest_rank_decides():
    def times(cid, kind, dtype, rows, rank):
        if cid == ONE:
            return 10.0 if rank == 0 else 19.9  # rank 1 makes ONESHOT lose its 2% margin
        return 20.0

    results, errors, _ = run_threads(2, lambda r: FakeMeasurer(r, times), spec(max_rows=2))
    assert not errors, errors
    points = results[0].measurements[("bfloat16", "plain")]
    assert points[0].times[ONE] == 19.9
    assert tbl.describe(results[1], "bfloat16", "plain") == "NCCL up to 28672 B"


def test_a_candidate_failing_on_one_rank_fails_on_all_is_skipped_above_and_the_workspace_is_rebuilt():
    failures = {(ONE, 2): ((1,), "call 1 sum: 3 of 14336 elements differ")}
    results, errors, measurers = run_threads(2, lambda r: FakeMeasurer(r, crossover_times, failures), spec())
    assert not errors, errors
    points = results[0].measurements[("bfloat16", "plain")]
    assert ONE in points[0].times
    assert points[1].failed[ONE].startswith("rank 1: verify: AssertionError: call 1 sum")
    assert points[2].failed[ONE].startswith("failed at 28672 B: rank 1:")
    assert all(ONE not in p.times for p in points[1:])
    assert [m.resets for m in measurers.values()] == [1, 1]
    assert (ONE, 3) not in measurers[0].verified and (ONE, 3) not in measurers[1].verified  # never tried again
    assert tbl.describe(results[0], "bfloat16", "plain") == "NCCL up to 57344 B"  # a one-size run is not enough
    assert results[0].digest() == results[1].digest()  # the same table on every rank, the failure in it


def test_the_verdict_fails_everywhere_when_one_rank_failed_or_bits_differ():
    assert reduce_verdicts([(None, "x"), (None, "x")]) is None
    assert reduce_verdicts([(None, "x"), ("verify: boom", None)]) == "rank 1: verify: boom"
    assert reduce_verdicts([(None, "x"), (None, "y")]).startswith("outputs differ across ranks")


def test_outputs_that_differ_between_ranks_fail_the_candidate():
    digests = {(ONE, 1, 1): "other bits"}
    results, errors, _ = run_threads(2, lambda r: FakeMeasurer(r, crossover_times, digests=digests), spec(max_rows=1))
    assert not errors, errors
    assert "outputs differ across ranks" in results[0].measurements[("bfloat16", "plain")][0].failed[ONE]


def test_an_excluded_candidate_is_recorded_with_its_reason_and_never_started():
    begun = []
    rule = {"dtype": "bfloat16", "kind": "plain", "candidate": ONE, "from_bytes": 2 * 14336,
            "reason": "rank 1 died (exit code -11) while running it"}
    results, errors, measurers = run_threads(
        2, lambda r: FakeMeasurer(r, crossover_times), spec(exclude=[rule]), progress=lambda r, e: begun.append(e))
    assert not errors, errors
    points = results[0].measurements[("bfloat16", "plain")]
    assert points[1].failed[ONE] == rule["reason"] and ONE in points[0].times
    assert {(e["candidate"], e["rows"]) for e in begun if e["candidate"] == ONE} == {(ONE, 1)}
    assert (ONE, 2) not in measurers[0].verified


def test_a_failing_nccl_routes_nothing_to_us_and_says_so():
    def times(cid, kind, dtype, rows, rank):
        if cid == "nccl":
            raise RuntimeError("NCCL error: invalid usage (duplicate GPU)")
        return 1.0

    results, errors, _ = run_threads(2, lambda r: FakeMeasurer(r, times), spec(max_rows=2))
    assert not errors, errors
    assert tbl.describe(results[0], "bfloat16", "plain") == "NCCL up to 28672 B"
    assert any("NCCL failed at 14336 B" in n for n in results[0].notes)


def test_the_debug_incumbent_time_is_used_and_labelled():
    results, errors, measurers = run_threads(2, lambda r: FakeMeasurer(r, crossover_times), spec(debug_nccl_us=1e6))
    assert not errors, errors
    assert tbl.describe(results[0], "bfloat16", "plain") == "ONESHOT/push/host up to 57344 B"
    assert any(n.startswith("DEBUG: NCCL was not measured") for n in results[0].notes)
    assert not [t for t in measurers[0].timed if t[0] == "nccl"]


def test_ranks_that_see_different_workspaces_refuse_to_tune():
    def make(rank):
        m = FakeMeasurer(rank, crossover_times)
        if rank == 1:
            m.shape = lambda: WorkspaceShape(m.world, "device", "pcie")
        return m

    _, errors, _ = run_threads(2, make, spec(max_rows=1))
    assert set(errors) == {0, 1} and all(isinstance(e, TuneError) for e in errors.values())


def test_ranks_whose_kernel_libraries_differ_refuse_to_tune():
    def make(rank):
        m = FakeMeasurer(rank, crossover_times)
        if rank == 1:
            m.limits = lambda: dataclasses.replace(kernel_limits(), max_fused_hidden=1024)
        return m

    _, errors, _ = run_threads(2, make, spec(max_rows=1))
    assert set(errors) == {0, 1} and all("different kernel libraries" in str(e) for e in errors.values()), errors


@pytest.mark.parametrize("max_rows, quick, expected", [
    (1, True, [1]),
    (5, True, [1, 2, 3, 4, 5]),
    (128, True, [1, 2, 3, 4, 6, 8, 16, 32, 64, 128]),
    (20, False, list(range(1, 17)) + [20]),
])
def test_the_rows_ladder(max_rows, quick, expected):
    assert rows_ladder(max_rows, quick) == expected


def test_the_full_ladder_grows_by_a_quarter_at_most_and_ends_at_the_bound():
    rows = rows_ladder(1000, quick=False)
    assert rows[:16] == list(range(1, 17)) and rows[-1] == 1000
    assert all(b <= max(a + 1, a * 1.25) + 1 for a, b in zip(rows, rows[1:], strict=False))


def test_the_spec_survives_json():
    s = spec(exclude=[{"dtype": "bfloat16"}], graph_rows=[1, 4], debug_nccl_us=1e6)
    assert TuneSpec(**json.loads(json.dumps(dataclasses.asdict(s)))) == s
    quick = TuneSpec.make(7168, 16, quick=True, dtypes=["float16"])
    assert (quick.calls, quick.iters, quick.survivors, quick.dtypes) == (4, 8, 3, ["float16"])


# ---------------------------------------------------------------------------------------------------------
# The same agreement over gloo, one process per rank


def _gloo_rank(rank, world, port, queue):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))

    def gather(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    def times(cid, kind, dtype, rows, r):
        base = {"nccl": 20.0, ONE: 10.0, TWO: 15.0}[cid]
        return base * (1.5 if (r == world - 1 and cid == ONE and rows >= 3) else 1.0)  # the last rank is slow there

    failures = {(TWO, 2): ((0,), "scratch not clean")}
    try:
        table = Tuner(FakeMeasurer(rank, times, failures, world=world), spec(), rank=rank, world=world,
                      gather=gather, key=KEY).run()
        queue.put((rank, table.digest(), tbl.describe(table, "bfloat16", "plain")))
    except Exception as exc:  # reported to the test
        queue.put((rank, None, repr(exc)))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_over_gloo():
    world = 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    answers = sorted(queue.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
    digests = {digest for _, digest, _ in answers}
    assert len(digests) == 1 and None not in digests, answers
    # ONESHOT wins everywhere (its slowest rank: 10, then 15 from rows 3, against NCCL's 20); TWOSHOT failed on
    # rank 0 at rows 2, so on every rank, and is not tried again.
    assert answers[0][2] == "ONESHOT/push/host up to 57344 B"


def test_a_candidate_far_slower_than_nccl_is_pruned_and_once_none_is_left_nothing_is_timed():
    def times(cid, kind, dtype, rows, rank):
        return {"nccl": 10.0, ONE: 10.0 if rows == 1 else 16.0, TWO: 16.0}[cid]  # both > 1.5x NCCL from rows 2

    results, errors, measurers = run_threads(2, lambda r: FakeMeasurer(r, times, world=4),
                                             spec(max_rows=5))
    assert not errors, errors
    points = results[0].measurements[("bfloat16", "plain")]
    assert points[2].failed[TWO].startswith("pruned: slower than 1.5x NCCL at 2 consecutive sizes up to 28672 B")
    assert points[3].failed[ONE].startswith("pruned") and points[3].times == {}
    assert points[3].failed["nccl"] == "not timed: no candidate of ours left to compare with"
    assert {t[1] for t in measurers[0].timed} == {1, 2, 3}
    assert tbl.describe(results[0], "bfloat16", "plain") == "NCCL up to 71680 B"


def test_pruning_compares_with_nccl_only_never_with_another_candidate():
    def times(cid, kind, dtype, rows, rank):
        return {"nccl": 20.0, ONE: 5.0 if rows <= 2 else 25.0, TWO: 12.0 if rows <= 2 else 10.0}[cid]

    results, errors, _ = run_threads(2, lambda r: FakeMeasurer(r, times, world=4), spec())
    assert not errors, errors
    # TWOSHOT was 2.4x slower than ONESHOT at rows 1-2 but kept, and takes over where ONESHOT loses to NCCL; the
    # sizes between rows 2 and 3, whose measured neighbours chose different routes, are NCCL's
    assert tbl.describe(results[0], "bfloat16", "plain") == \
        "ONESHOT/push/host up to 28672 B, NCCL up to 43007 B, TWOSHOT/push/host up to 57344 B"


def test_the_ladder_measures_every_captured_row_count_and_none_past_the_bound():
    from sglang_sm120.tuning.tuner import graph_rows

    captured = graph_rows([1, 2, 4, 8, 12, 16, 24, 32], 4)
    assert captured == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    quick = rows_ladder(128, True, captured)
    assert set(captured) <= set(quick) and quick == sorted(set(quick))
    assert rows_ladder(64, True, captured)[-1] == 64 and 96 not in rows_ladder(64, True, captured)
    assert set(rows_ladder(128, False, captured)) >= set(captured)
    with pytest.raises(ValueError):
        rows_ladder(8, True, [0])


def test_a_quick_tune_tries_a_captured_size_off_the_ladder_with_the_candidates_profiled_on_either_side():
    """The ladder's sizes see every candidate; a captured size between two of them sees only what was profiled
    there (and NCCL), so a server's many captured sizes stay cheap to measure and each is still measured."""
    def times(cid, kind, dtype, rows, rank):
        return 20.0 if cid == "nccl" else 10.0 if "/push/" in cid else 15.0

    def make(rank):
        m = FakeMeasurer(rank, times, world=2)
        m.shape = lambda: WorkspaceShape(2, "device", "pcie", sm_budget=16)
        return m

    quick = spec(quick=True, survivors=1, max_rows=8, graph_rows=[5, 7])
    results, errors, measurers = run_threads(2, make, quick)
    assert not errors, errors
    points = {p.rows: p for p in results[0].measurements[("bfloat16", "plain")]}
    assert sorted(points) == [1, 2, 3, 4, 5, 6, 7, 8]
    tried = {rows: {cid for cid, r in measurers[0].verified if r == rows} for rows in points}
    assert all(len(tried[rows]) > 2 for rows in (4, 6, 8))  # the ladder: every candidate
    profiled_near = {cid for rows in (4, 6) for cid in points[rows].times if cid != "nccl"}
    assert tried[5] and tried[5] <= profiled_near, (tried[5], profiled_near)  # those that launch at 5 rows
    assert "nccl" in points[5].times and points[5].times.keys() - {"nccl"} <= profiled_near
