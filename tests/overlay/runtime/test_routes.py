"""The group's routes: the seeds, and a table (only what it measured, only what this workspace can run)."""

from __future__ import annotations

from sgl_kernel_sm120.variants import Variant
from sglang_sm120.routing.table import NCCL, Point, RoutingTable
from sglang_sm120.runtime.routes import SEEDS, TABLE, RouteBook
from sglang_sm120.tuning.candidates import KernelOffer

ROW = 7168 * 2


def table(times_by_candidate, kind="plain", rows=(1, 2, 3, 4), nccl=20.0):
    points = [Point(r, r * ROW, {NCCL: nccl, **{cid: series[i] for cid, series in times_by_candidate.items()}})
              for i, r in enumerate(rows)]
    return RoutingTable.from_points(key={"world_size": 2}, measured="2026-12-03T10:00:00Z",
                                    workload={"hidden": 7168}, measurements={("bfloat16", kind): points})


PUSH = KernelOffer()


def book(t, memory="device", num_islands=1, offer=PUSH):
    return RouteBook(TABLE, table=t, path="/cache/routes.json", memory=memory, num_islands=num_islands, offer=offer)


def test_the_seeds_route_every_size_to_the_kernels_own_choice():
    seeds = RouteBook.seeds()
    assert seeds.source == SEEDS and seeds.call(ROW, "bfloat16", False) == (None, {})
    assert seeds.source_line() == ("routes: seeds, UNMEASURED on this box: every size within the bound goes to the "
                                   "sm120 kernels (--sm120-allreduce-tune off; python -m sglang_sm120.tune measures "
                                   "this box)")
    assert seeds.describe("bfloat16", ROW) == ""


def test_a_table_sends_the_sizes_nccl_won_to_nccl_and_names_the_variant_of_the_others():
    b = book(table({"sm120/TWOSHOT/push/device": [10, 10, 30, 30]}))
    route, kwargs = b.call(ROW, "bfloat16", False)
    assert route.id == "sm120/TWOSHOT/push/device" and kwargs == {"variant": Variant.TWOSHOT}
    assert b.call(3 * ROW, "bfloat16", False) is None
    assert b.call(5 * ROW, "bfloat16", False) is None  # past what was measured
    assert b.call(ROW, "float16", False) is None and b.call(ROW, "bfloat16", True) is None
    assert b.source_line() == "routes: tuned table /cache/routes.json, measured 2026-12-03T10:00:00Z"
    assert b.describe("bfloat16", 4 * ROW).startswith("plain: TWOSHOT/push/device up to 28672 B, NCCL up to 57344 B")


def test_routes_this_workspace_cannot_run_go_to_nccl():
    host = book(table({"sm120/ONESHOT/push/device": [10] * 4}), memory="host")
    assert host.call(ROW, "bfloat16", False) is None
    flat = book(table({"sm120/ISLAND/push/device": [10] * 4}), num_islands=1)
    assert flat.call(ROW, "bfloat16", False) is None
    assert book(table({"sm120/ISLAND/push/device": [10] * 4}), num_islands=2).call(ROW, "bfloat16", False)
    pull = table({"sm120/ONESHOT/pull/device": [10] * 4})
    assert book(pull).call(ROW, "bfloat16", False) is None  # this build pushes only
    offered = KernelOffer(("push", "pull"), call_transport=True)
    assert book(pull, offer=offered).call(ROW, "bfloat16", False)[1]["transport"] == "pull"


def test_the_server_info_view():
    b = book(table({"sm120/ONESHOT/push/device": [10] * 4}))
    view = b.as_dict("bfloat16", 4 * ROW)
    assert view["source"] == "table" and view["path"] == "/cache/routes.json" and "ONESHOT" in view["routes"]
    assert RouteBook.seeds("no table").as_dict(None, 0) == {
        "source": "seeds", "line": RouteBook.seeds().source_line(), "why": "no table",
        "routes": "all sizes within the bound: seeds"}
    nccl = RouteBook.all_nccl("the quick tune at start-up failed (rank 1: exit code -9)")
    assert nccl.as_dict("bfloat16", 4 * ROW) == {
        "source": "nccl", "why": "the quick tune at start-up failed (rank 1: exit code -9)",
        "routes": "all sizes: NCCL",
        "line": "routes: all NCCL because the quick tune at start-up failed (rank 1: exit code -9) (retry: "
                "--sm120-allreduce-tune force, or python -m sglang_sm120.tune)"}


def test_all_nccl_routes_every_size_to_nccl():
    nccl = RouteBook.all_nccl("why")
    assert all(nccl.call(n, d, f) is None for n in (16, ROW, 1 << 20) for d in ("bfloat16", "float16")
               for f in (False, True))


def test_a_cluster_size_the_workspace_does_not_launch_goes_to_nccl_not_to_another_launch():
    fused = table({"sm120/ONESHOT/push/device/c4": [10] * 4}, kind="fused")
    without = RouteBook(TABLE, table=fused, path="p", memory="device", clusters=(2,))
    assert without.call(ROW, "bfloat16", True) is None
    with_four = RouteBook(TABLE, table=fused, path="p", memory="device", clusters=(2, 4))
    assert with_four.call(ROW, "bfloat16", True)[0].id == "sm120/ONESHOT/push/device/c4"
    one = table({"sm120/ONESHOT/push/device/c1": [10] * 4}, kind="fused")
    assert RouteBook(TABLE, table=one, path="p", memory="device").call(ROW, "bfloat16", True)  # one CTA: always
