"""Finding or making a group's routing table at build time, on CPU: ranks as threads agreeing over an in-memory
store, the key facts and the tune's child processes replaced by stand-ins."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist

from sgl_kernel_sm120.policy import WorkspaceShape, kernel_limits
from sglang_sm120.core import exchange
from sglang_sm120.routing import cache
from sglang_sm120.routing.table import NCCL, Point, RoutingTable, make_key, route_id
from sglang_sm120.runtime import route_resolution
from sglang_sm120.tuning import launch

HIDDEN, ROW = 7168, 7168 * 2
_names = itertools.count()


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(exchange, "VERDICT_GRACE_S", 0.5)


def facts(rank):
    return {"uuid": f"GPU-{rank}", "pci_bus_id": f"00000000:0{rank}:00.0", "name": "RTX PRO 6000",
            "driver": "580.1", "cuda": "13.0", "torch": "2.14.1", "nccl": "2.27.3", "sglang_sm120": "0.1.0",
            "kernels": "lib:1:2"}


P2P = [[True, True], [True, True]]
LAUNCH = {"clusters": [2, 4], "sm_budget": 188, "pdl": True,
          "switches": {"SGL_SM120_FUSED_CLUSTERS": "", "SGL_SM120_AR_PDL": ""}}
KEY = make_key([facts(0), facts(1)], islands=None, p2p=P2P, memory="device", launch=LAUNCH)
SHAPE = WorkspaceShape(2, "device", "pcie", clusters=(2, 4), sm_budget=188)
ONE = "sm120/ONESHOT/push/device"


def a_table(key=KEY, rows=4, dtype="bfloat16"):
    measurements = {}
    for kind in ("plain", "fused"):
        measurements[(dtype, kind)] = [Point(r, r * ROW, {NCCL: 20.0, "sm120/ONESHOT/push/device": 10.0})
                                       for r in range(1, rows + 1)]
    return RoutingTable.from_points(key=key, measured="2026-12-03T10:00:00Z",
                                    workload={"hidden": HIDDEN, "max_bytes": rows * ROW}, measurements=measurements)


class Children:
    """Stands in for launch.run_rank_child: records the calls, answers with `answer(rank, spec)`."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, rank, world, device, port, spec, *, timeout_s, stall_s):
        self.calls.append({"rank": rank, "world": world, "device": device, "port": port, "spec": spec})
        return self.answer(rank, spec)


def good_child(rank, spec):
    table = a_table(rows=spec.max_rows)
    return launch.ChildOutcome(rank, returncode=0, table=table.to_dict(), digest=table.digest())


def resolve_all(tune, children=None, world=2, facts_fn=facts, max_bytes=4 * ROW, library=lambda rank: "lib:1:2",
                launch_of=lambda rank: LAUNCH, graph_rows=(), lost=None, agree_timeout_s=5.0):
    """`lost`: (rank, step) of an agreement that rank never takes part in (it fails there at once)."""
    store, name, logs = dist.HashStore(), f"tables-{next(_names)}", []
    out = {}

    def body(rank):
        counter = itertools.count()

        def agree(step, payload, timeout_s=None):
            if lost == (rank, step):
                raise exchange.AgreementFailed(f"rank {rank} lost its connection at {step}")
            return exchange.agree(store, f"{name}/{step}/{next(counter)}", rank, world, payload,
                                  timeout_s or agree_timeout_s)

        out[rank] = route_resolution.resolve_routes(
            agree=agree, rank=rank, world=world, device=torch.device("cuda", rank), shape=SHAPE,
            limits=kernel_limits(), islands=None, p2p=P2P, hidden=HIDDEN, dtype=torch.bfloat16,
            max_bytes=max_bytes, tune=tune, tune_timeout_s=30.0, launch_facts=launch_of(rank),
            log=lambda level, text, r=rank: logs.append((level, text)) if r == 0 else None,
            facts=lambda device, r=rank: facts_fn(r), library=lambda r=rank: library(r), run_child=children,
            graph_rows=graph_rows)

    errors = {}

    def run(rank):
        try:
            body(rank)
        except BaseException as exc:  # noqa: BLE001 - resolve_routes must not raise: reported below
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not [t.name for t in threads if t.is_alive()], "ranks still resolving after 60 s"
    assert not errors, f"resolve_routes raised: {errors!r}"
    assert sorted(out) == list(range(world)), sorted(out)
    return out, logs


def warnings(logs):
    return [text for level, text in logs if level >= logging.WARNING]


def test_a_table_of_this_box_is_used_by_every_rank_without_measuring():
    path = cache.save(a_table())
    children = Children(good_child)
    books, logs = resolve_all("auto", children)
    assert {b.source for b in books.values()} == {"table"} and {b.path for b in books.values()} == {path}
    assert children.calls == [] and warnings(logs) == []


def test_no_table_with_tuning_off_is_the_seeds_quietly():
    books, logs = resolve_all("off", Children(good_child))
    assert {b.source for b in books.values()} == {"seeds"} and warnings(logs) == []


@pytest.mark.parametrize("damage, status", [
    (lambda path: open(path, "w").write("{"), "corrupt (bad JSON"),
    (lambda path: json.dump({**a_table(key={**KEY, "driver": "570.0"}).to_dict()}, open(path, "w")),
     "other versions (driver '570.0' -> '580.1'"),
    (lambda path: json.dump({**a_table(key={**KEY, "memory": "host"}).to_dict()}, open(path, "w")),
     "another key (memory 'host' -> 'device'"),
])
def test_a_stale_or_corrupt_table_is_ignored_with_a_warning_saying_which(damage, status):
    path = cache.table_path(KEY, HIDDEN)
    cache.save(a_table(), path=path)
    damage(path)
    books, logs = resolve_all("off", Children(good_child))
    assert {b.source for b in books.values()} == {"seeds"}
    assert len(warnings(logs)) == 1 and f"routing table {path} ignored: {status}" in warnings(logs)[0], logs


def test_a_table_that_does_not_reach_the_bound_is_measured_again_in_auto_mode():
    cache.save(a_table(rows=2))
    children = Children(good_child)
    books, logs = resolve_all("auto", children, max_bytes=4 * ROW)
    assert {b.source for b in books.values()} == {"table"}
    assert "does not cover" in warnings(logs)[0]
    assert cache.load(KEY, hidden=HIDDEN, dtype="bfloat16", max_bytes=4 * ROW).ok  # the new one was saved


def test_without_a_table_auto_runs_one_quick_tune_child_per_rank_and_saves_its_table():
    children = Children(good_child)
    books, logs = resolve_all("auto", children, max_bytes=4 * ROW + 100)
    assert sorted(c["rank"] for c in children.calls) == [0, 1]
    assert len({c["port"] for c in children.calls}) == 1 and [c["device"] for c in children.calls] != [None]
    spec = children.calls[0]["spec"]
    assert spec.quick and spec.max_rows == 4 and spec.dtypes == ["bfloat16"] and spec.kinds == ["plain", "fused"]
    assert spec.memory == "device" and spec.islands_given and spec.islands is None and spec.link == "pcie"
    assert {b.source for b in books.values()} == {"table"}
    path = cache.table_path(KEY, HIDDEN)
    assert {b.path for b in books.values()} == {path} and cache.load_file(path).ok
    assert any("measuring a quick one now" in w for w in warnings(logs))


def test_force_measures_even_with_a_table():
    cache.save(a_table())
    children = Children(good_child)
    books, _ = resolve_all("force", children)
    assert len(children.calls) == 2 and {b.source for b in books.values()} == {"table"}


RETRY = "retry: --sm120-allreduce-tune force, or python -m sglang_sm120.tune"


def all_nccl(books, logs, cause):
    """Every rank routes every size to NCCL, and rank 0 logged one WARNING naming `cause` and the retry."""
    assert {b.source for b in books.values()} == {"nccl"}, books
    assert all(b.route(n, "bfloat16", fused) is None for b in books.values() for n in (16, ROW, 4 * ROW)
               for fused in (False, True))
    named = [w for w in warnings(logs) if "every all-reduce of this group goes to NCCL" in w]
    assert len(named) == 1 and cause in named[0] and RETRY in named[0], logs
    assert cause in books[0].source_line() and RETRY in books[0].source_line()


def crash(rank, spec):
    return launch.ChildOutcome(rank, returncode=-11, tail=["Segmentation fault"],
                               last_begin={"dtype": "bfloat16", "kind": "fused", "candidate": ONE, "rows": 3,
                                           "bytes": 3 * ROW, "seq": 7})


def test_a_failed_child_on_one_rank_means_nccl_everywhere_with_the_reason():
    def answer(rank, spec):
        if rank == 1:
            return launch.ChildOutcome(1, returncode=-9, killed="", tail=["Segmentation fault"])
        return good_child(rank, spec)

    books, logs = resolve_all("auto", Children(answer))
    all_nccl(books, logs, "the quick tune at start-up failed (rank 1: exit code -9: Segmentation fault)")
    assert not cache.load_file(cache.table_path(KEY, HIDDEN)).ok


@pytest.mark.parametrize("killed, cause", [
    ("the tune did not finish within 30 s", "the quick tune at start-up failed (rank 0: the tune did not finish "
                                            "within 30 s; rank 1: the tune did not finish within 30 s)"),
    ("no progress for 30 s", "no progress for 30 s"),
])
def test_a_child_timed_out_or_stalled_means_nccl(killed, cause):
    books, logs = resolve_all("auto", Children(lambda rank, spec: launch.ChildOutcome(
        rank, returncode=-9, killed=killed)))
    all_nccl(books, logs, cause)


def test_a_child_that_cannot_start_on_one_rank_is_a_failure_every_rank_hears_at_once():
    # e.g. fork refused (ENOMEM) in a process holding a large CUDA context: no wait for an agreement timeout
    def answer(rank, spec):
        if rank == 1:
            raise OSError(12, "Cannot allocate memory")
        return good_child(rank, spec)

    started = time.monotonic()
    books, logs = resolve_all("auto", Children(answer))
    all_nccl(books, logs, "rank 1: could not start the tune child: OSError: [Errno 12] Cannot allocate memory")
    assert time.monotonic() - started < 5.0  # the agreements' bound in these tests: nobody waited it out
    assert cache.blames(KEY) == []  # no candidate ran: none is blamed
    assert cache.recorded_failure(KEY, HIDDEN) is not None  # noted, so `auto` does not retry it every start


def test_a_child_out_of_memory_means_nccl():
    def answer(rank, spec):
        return launch.ChildOutcome(rank, returncode=1, error="OutOfMemoryError: CUDA out of memory")

    books, logs = resolve_all("auto", Children(answer))
    all_nccl(books, logs, "OutOfMemoryError: CUDA out of memory")
    assert cache.blames(KEY) == []  # the child's own error is no candidate's fault


def test_children_that_disagree_mean_nccl():
    def answer(rank, spec):
        table = a_table(rows=spec.max_rows + rank)
        return launch.ChildOutcome(rank, returncode=0, table=table.to_dict(), digest=table.digest())

    books, logs = resolve_all("auto", Children(answer))
    all_nccl(books, logs, "the quick tune at start-up gave the ranks different tables")


def test_a_tune_under_another_key_is_not_used():
    def answer(rank, spec):
        table = a_table(key={**KEY, "torch": "9.9"}, rows=spec.max_rows)
        return launch.ChildOutcome(rank, returncode=0, table=table.to_dict(), digest=table.digest())

    books, logs = resolve_all("auto", Children(answer))
    all_nccl(books, logs, "the quick tune measured under another key than the server's")


def test_a_rank_that_cannot_compute_its_key_means_nccl_everywhere():
    def flaky(rank):
        if rank == 1:
            raise RuntimeError("no NVML")
        return facts(rank)

    books, logs = resolve_all("auto", Children(good_child), facts_fn=flaky)
    all_nccl(books, logs, "the routing-table key could not be computed (rank 1: RuntimeError: no NVML)")


def test_resolving_that_raises_means_nccl(monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("cache unreadable")

    monkeypatch.setattr(cache, "load", broken)
    books, logs = resolve_all("auto", Children(good_child))
    all_nccl(books, logs, "resolving the routes failed (OSError: cache unreadable)")


def test_resolving_that_raises_on_one_rank_only_means_nccl_on_every_rank(monkeypatch):
    real = cache.load

    def broken_on_rank_1(key, **kwargs):
        if threading.current_thread().name == "rank1":
            raise OSError("cache unreadable")
        return real(key, **kwargs)

    cache.save(a_table())
    monkeypatch.setattr(cache, "load", broken_on_rank_1)
    books, logs = resolve_all("auto", Children(good_child))
    all_nccl(books, logs, "resolving the routes failed (AgreementFailed")


def test_seeds_run_only_when_asked_for_and_say_they_are_unmeasured():
    def flaky(rank):
        raise RuntimeError("no NVML")

    books, logs = resolve_all("off", Children(good_child), facts_fn=flaky)
    assert {b.source for b in books.values()} == {"seeds"}
    assert route_id(books[0].route(ROW, "bfloat16", False)) == "sm120/ONESHOT/push/device"  # the seed route
    assert "UNMEASURED" in books[0].source_line() and "--sm120-allreduce-tune off" in books[0].source_line()


def test_a_failed_quick_tune_is_not_run_again_at_the_next_start_until_forced():
    resolve_all("auto", Children(crash))
    note = cache.recorded_failure(KEY, HIDDEN)
    assert note and "the quick tune at start-up failed (rank 0: exit code -11" in note["why"]
    again = Children(good_child)
    books, logs = resolve_all("auto", again)
    assert again.calls == []
    all_nccl(books, logs, "is not run again until forced")
    assert "the quick tune failed on this box on" in books[0].why
    forced = Children(good_child)
    books, _ = resolve_all("force", forced)
    assert len(forced.calls) == 2 and {b.source for b in books.values()} == {"table"}
    assert cache.recorded_failure(KEY, HIDDEN) is None  # the saved table cleared the note


def test_a_candidate_blamed_for_a_crash_is_never_routed_nor_tuned_again():
    books, logs = resolve_all("auto", Children(crash))
    all_nccl(books, logs, f"{ONE} is blamed and never routed to on this box")
    blamed = cache.blames(KEY)
    assert [(b["candidate"], b["kind"], b["from_bytes"]) for b in blamed] == [(ONE, "fused", 3 * ROW)]
    # The next tune (forced) is told to leave it out ...
    forced = Children(good_child)
    books, _ = resolve_all("force", forced)
    exclude = forced.calls[0]["spec"].exclude
    assert [(r["candidate"], r["kind"], r["from_bytes"]) for r in exclude] == [(ONE, "fused", 3 * ROW)]
    # ... and a table that routes it there anyway (a tool's, say) is served without it from that size up.
    assert {b.source for b in books.values()} == {"table"}
    book = books[0]
    assert route_id(book.route(2 * ROW, "bfloat16", True)) == ONE
    assert book.route(3 * ROW, "bfloat16", True) is None and book.route(4 * ROW, "bfloat16", True) is None
    assert route_id(book.route(4 * ROW, "bfloat16", False)) == ONE  # the plain kind was not blamed


def test_force_with_a_failure_keeps_the_previous_table():
    path = cache.save(a_table())
    books, logs = resolve_all("force", Children(crash))
    assert {b.source for b in books.values()} == {"table"} and {b.path for b in books.values()} == {path}
    kept = [w for w in warnings(logs) if "routing by the table there was before" in w]
    assert len(kept) == 1 and "the quick tune at start-up failed" in kept[0] and RETRY in kept[0]
    assert books[0].route(3 * ROW, "bfloat16", True) is None  # still: the blamed candidate is not routed
    assert route_id(books[0].route(ROW, "bfloat16", False)) == ONE


@pytest.mark.parametrize("field, differ", [
    ("library", {"library": lambda rank: f"lib:{rank}:2"}),
    ("launch", {"launch_of": lambda rank: {**LAUNCH, "clusters": [2, 4] if rank == 0 else []}}),
])
def test_ranks_that_run_different_kernels_end_on_nccl_whatever_the_setting(field, differ):
    cache.save(a_table())
    for tune in ("auto", "off"):
        children = Children(good_child)
        books, logs = resolve_all(tune, children, **differ)
        all_nccl(books, logs, f"the ranks do not run the same kernels ({field}: rank 0 ")
        assert children.calls == []


def test_a_hand_edited_table_is_recomputed_from_its_measurements():
    doc = a_table().to_dict()
    doc["entries"] = [dict(e, route="nccl") if e["kind"] == "plain" else e for e in doc["entries"]]
    with open(cache.table_path(KEY, HIDDEN), "w") as handle:
        json.dump(doc, handle)
    books, logs = resolve_all("auto", Children(good_child))
    assert {b.source for b in books.values()} == {"table"}
    assert route_id(books[0].route(ROW, "bfloat16", False)) == ONE  # what its measurements give, not the edit
    differ = [w for w in warnings(logs) if "its routes are not what its measurements give" in w]
    assert len(differ) == 1 and "bfloat16 plain: stored NCCL up to 57344 B" in differ[0], logs


def test_the_quick_tune_measures_every_row_count_the_server_runs_in_cuda_graphs():
    children = Children(good_child)
    resolve_all("auto", children, max_bytes=128 * ROW, graph_rows=[1, 2, 4, 8, 12, 16, 24, 32, 48, 96, 128, 12])
    spec = children.calls[0]["spec"]
    assert spec.graph_rows == [1, 2, 4, 8, 12, 16, 24, 32, 48, 96, 128]
    assert set(spec.graph_rows) <= set(spec.rows) and {12, 24, 48, 96} <= set(spec.rows)


def test_ranks_that_ended_on_different_routes_all_go_to_nccl(monkeypatch):
    """The last agreement compares what every rank will route by: a rank that derived other routes from the same
    table (whatever the cause) sends the whole group to NCCL rather than into a wait for calls that never come."""
    cache.save(a_table())
    real = RoutingTable.rederived

    def rank_1_derives_other_routes(self, blamed=()):
        derived = real(self, blamed)
        if threading.current_thread().name == "rank1":
            derived.entries = [e for e in derived.entries if e.kind == "plain"]
        return derived

    monkeypatch.setattr(RoutingTable, "rederived", rank_1_derives_other_routes)
    books, logs = resolve_all("auto", Children(good_child))
    all_nccl(books, logs, "the ranks ended on different routes: rank 0 table, rank 1 table")


def test_a_rank_that_drops_out_of_the_last_agreement_leaves_every_rank_on_nccl():
    cache.save(a_table())
    books, logs = resolve_all("auto", Children(good_child), lost=(1, "routes-final"), agree_timeout_s=1.0)
    assert {b.source for b in books.values()} == {"nccl"}
    assert "could not agree on their routes" in books[0].why and "could not agree on their routes" in books[1].why
    assert any("every all-reduce of this group goes to NCCL" in w and RETRY in w for w in warnings(logs))
