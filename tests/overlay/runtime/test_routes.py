"""Which routing table a group routes by, on CPU: ranks as threads agreeing over an in-memory store, the tables
written to the test's own cache folder."""

from __future__ import annotations

import itertools
import json
import logging
import threading

import pytest
import torch.distributed as dist

from sgl_kernel_sm120.policy import KernelLimits, WorkspaceShape
from sglang_sm120.core import exchange
from sglang_sm120.routing import cache
from sglang_sm120.routing.table import NCCL, Point, RoutingTable, make_key
from sglang_sm120.runtime import routes

HIDDEN, ROW = 7168, 7168 * 2
LIMITS = KernelLimits(plain_max_threads=1024, max_packs_per_thread=8, max_fused_hidden=65536, max_world=8,
                      max_ctas=1024, pack_bytes=16, elems_per_pack=8, owner_block_packs=32)
SHAPE = WorkspaceShape(2, "device", "pcie", clusters=(2, 4), sm_budget=188)
LAUNCH = {"clusters": [2, 4], "sm_budget": 188, "pdl": True, "switches": {}}
P2P = [[True, True], [True, True]]
ONE = "sm120/ONESHOT/push/device"
_names = itertools.count()


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(exchange, "VERDICT_GRACE_S", 0.5)


def facts(rank, **changes):
    return {"uuid": f"GPU-{rank}", "pci_bus_id": f"00000000:0{rank}:00.0", "name": "RTX PRO 6000",
            "driver": "580.1", "cuda": "13.0", "torch": "2.14.1", "nccl": "2.27.3", "nccl_settings": {},
            "sglang_sm120": "0.1.0", "kernels": "lib:1:2", **changes}


def save_table(rows=4, candidate=ONE, **changes):
    key = make_key([facts(0, **changes), facts(1, **changes)], islands=None, p2p=P2P, memory="device",
                   launch=LAUNCH)
    points = [Point(r, r * ROW, {NCCL: 20.0, candidate: 10.0}) for r in range(1, rows + 1)]
    table = RoutingTable.from_points(key=key, measured="2026-12-03T10:00:00Z", workload={"hidden": HIDDEN},
                                     measurements={("bfloat16", k): points for k in ("plain", "fused")})
    return cache.save(table)


def resolve_all(tune="auto", keys=None, launch_of=lambda rank: LAUNCH, max_bytes=4 * ROW, cache_of=None):
    """Every rank's RouteBook and rank 0's log lines. `cache_of(rank)`: that rank's cache folder."""
    store, name, logs, out = dist.HashStore(), f"routes-{next(_names)}", [], {}
    keys = keys or [facts(0), facts(1)]

    def body(rank):
        def agree(step, payload):
            prefix = exchange.next_prefix(f"{name}/{step}", rank)
            return exchange.agree(store, prefix, rank, 2, payload, 2.0)

        def log(level, text):
            if rank == 0:
                logs.append((level, text))

        out[rank] = routes.resolve_routes(agree=agree, keys=keys, islands=None, p2p=P2P, shape=SHAPE, limits=LIMITS,
                                          hidden=HIDDEN, dtype="bfloat16", max_bytes=max_bytes, tune=tune,
                                          launch=launch_of(rank), log=log)

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(out) == [0, 1]
    return out, logs


def test_every_rank_reading_the_same_table_routes_by_it():
    path = save_table()
    books, logs = resolve_all()
    assert all(b.source == "table" and b.path == path for b in books.values())
    assert books[0].route(2 * ROW, "bfloat16", False).id == "ONESHOT/push/device/b188/t64"
    assert not [text for level, text in logs if level >= logging.WARNING]


@pytest.mark.parametrize("tune, source", [("auto", "nccl"), ("force", "nccl"), ("off", "seeds")])
def test_without_a_table_every_size_goes_to_nccl_unless_the_seeds_were_asked_for(tune, source):
    books, logs = resolve_all(tune=tune)
    assert {b.source for b in books.values()} == {source}
    if source == "nccl":
        assert books[0].route(2 * ROW, "bfloat16", False) is None
        text = logs[-1][1]
        assert logs[-1][0] == logging.WARNING and "no routing table of this box" in text, text
        assert "python -m sglang_sm120.tune --tp 2 --hidden 7168" in text, text


def test_a_table_measured_under_other_nccl_settings_is_named_and_not_used():
    save_table(nccl_settings={"NCCL_P2P_LEVEL": "SYS"})
    books, logs = resolve_all()
    assert books[0].source == "nccl"
    assert "other versions (nccl_settings {'NCCL_P2P_LEVEL': 'SYS'} -> {}" in logs[-1][1], logs


def test_ranks_whose_workspaces_launch_differently_go_to_nccl_even_with_the_seeds_asked_for():
    save_table()
    books, logs = resolve_all(tune="off", launch_of=lambda rank: {**LAUNCH, "sm_budget": 188 - rank})
    assert {b.source for b in books.values()} == {"nccl"}
    assert "the ranks' workspaces launch differently" in logs[-1][1]


def test_a_rank_without_key_facts_ends_every_rank_on_nccl():
    books, logs = resolve_all(keys=[facts(0), None])
    assert {b.source for b in books.values()} == {"nccl"}
    assert "ranks [1] sent no key facts" in logs[-1][1]


def test_the_ranks_reading_different_tables_go_to_nccl(tmp_path, monkeypatch):
    save_table()
    shared = cache.cache_dir()
    monkeypatch.setattr(cache, "cache_dir", lambda: str(tmp_path) if threading.current_thread().name == "rank1"
                        else shared)  # rank 1 finds no table where rank 0 finds one
    books, logs = resolve_all()
    assert {b.source for b in books.values()} == {"nccl"}
    assert "the ranks read different routing tables" in logs[-1][1], logs


def test_a_blamed_candidate_is_never_routed_and_a_table_short_of_the_bound_says_so():
    save_table(rows=4)
    key = make_key([facts(0), facts(1)], islands=None, p2p=P2P, memory="device", launch=LAUNCH)
    cache.record_blames(key, [{"dtype": "bfloat16", "kind": "plain", "candidate": ONE, "from_bytes": 3 * ROW,
                               "reason": "hung"}], "now")
    books, logs = resolve_all(max_bytes=8 * ROW)
    book = books[0]
    assert book.source == "table" and book.route(2 * ROW, "bfloat16", False) is not None
    assert book.route(3 * ROW, "bfloat16", False) is None  # blamed from 3 rows on
    texts = " ".join(text for _, text in logs)
    assert "without the blamed candidates" in texts and f"this server's bound is {8 * ROW} B" in texts, texts


def test_ranks_reading_two_different_tables_of_the_key_go_to_nccl_without_a_traceback(tmp_path, monkeypatch):
    """A table replaced between two ranks' reads (a second server's forced tune): both valid, two digests."""
    save_table(rows=4)
    shared = cache.cache_dir()
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    save_table(rows=3)
    monkeypatch.setenv("SGLANG_SM120_CACHE", shared)
    monkeypatch.setattr(cache, "cache_dir", lambda: str(tmp_path) if threading.current_thread().name == "rank1"
                        else shared)
    books, logs = resolve_all()
    assert {b.source for b in books.values()} == {"nccl"}
    warnings = [text for level, text in logs if level >= logging.WARNING]
    assert len(warnings) == 1 and "the ranks read different routing tables of this key" in warnings[0], logs


def _corrupt(edit):
    path = save_table()
    with open(path, encoding="utf-8") as handle:
        doc = json.load(handle)
    edit(doc)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(doc, handle)


@pytest.mark.parametrize("edit, says", [
    (lambda doc: doc.pop("rule"), None),  # an old table's default rule: still usable
    (lambda doc: doc.update(rule={"min_gain": 0.02}), "sustain"),
    (lambda doc: doc.update(rule={"min_gain": "much", "sustain": 2}), "bad rule"),
    (lambda doc: doc["measurements"].reverse(), "ascending"),
    (lambda doc: doc["measurements"].insert(1, dict(doc["measurements"][0])), "ascending"),
    (lambda doc: doc["measurements"][0].update(times={"nccl": "fast"}), "bad measurement"),
    (lambda doc: doc["measurements"][0].update(rows=None), "bad measurement"),
    (lambda doc: doc.update(durations={"total": [1]}), "durations"),
    (lambda doc: doc.update(workload={"hidden": "wide"}), "hidden"),
    (lambda doc: doc["entries"].append({"dtype": "bfloat16", "kind": "plain", "low": 1, "high": 2, "route": "x"}),
     "bad entry"),
])
def test_a_malformed_table_ends_every_rank_on_nccl_with_one_warning_naming_it(edit, says):
    _corrupt(edit)
    books, logs = resolve_all()
    warnings = [text for level, text in logs if level >= logging.WARNING]
    if says is None:
        assert {b.source for b in books.values()} == {"table"}, logs
        return
    assert {b.source for b in books.values()} == {"nccl"}
    assert len(warnings) == 1 and "corrupt" in warnings[0] and says in warnings[0], warnings


def test_an_unreadable_cache_folder_ends_every_rank_on_nccl_with_one_warning(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(blocked))
    books, logs = resolve_all()
    warnings = [text for level, text in logs if level >= logging.WARNING]
    assert {b.source for b in books.values()} == {"nccl"}
    assert len(warnings) == 1 and "every all-reduce of this group goes to NCCL" in warnings[0], warnings


def test_a_failure_while_routing_by_an_agreed_table_ends_on_nccl_not_in_a_traceback(monkeypatch):
    save_table()

    def broken(*args, **kwargs):
        raise KeyError("sustain")

    monkeypatch.setattr(RoutingTable, "rederived", broken)
    books, logs = resolve_all()
    warnings = [text for level, text in logs if level >= logging.WARNING]
    assert {b.source for b in books.values()} == {"nccl"}
    assert len(warnings) == 1 and "resolving the routes failed (KeyError" in warnings[0], warnings


def test_a_failed_tune_of_these_gpus_is_named_with_the_command_that_retries():
    key = make_key([facts(0), facts(1)], islands=None, p2p=P2P, memory="device", launch=LAUNCH)
    cache.record_failure(key, HIDDEN, "rank 1 died (exit code -9)", "python -m sglang_sm120.tune --tp 2 ...",
                         planned="x")
    books, logs = resolve_all()
    text = logs[-1][1]
    assert books[0].source == "nccl" and "the last tune of these GPUs failed at" in text, text
    assert "rank 1 died (exit code -9)" in text and "retry with python -m sglang_sm120.tune --tp 2" in text, text
