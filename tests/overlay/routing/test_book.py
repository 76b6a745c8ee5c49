"""A group's routes: the seeds, and a table (only what it measured, only what this workspace runs as measured)."""

from __future__ import annotations

import pytest

from sgl_kernel_sm120.policy import Route, Schedule, Transport, WorkspaceShape, kernel_limits
from sglang_sm120.routing.book import ALL_NCCL, SEEDS, TABLE, RouteBook
from sglang_sm120.routing.table import NCCL, Point, RoutingTable, route_id

ROW = 7168 * 2
LIMITS = kernel_limits()
DEVICE = WorkspaceShape(2, "device", "pcie", clusters=(2, 4, 8), sm_budget=188)


def table(times_by_candidate, kind="plain", rows=(1, 2, 3, 4), nccl=20.0):
    points = [Point(r, r * ROW, {NCCL: nccl, **{cid: series[i] for cid, series in times_by_candidate.items()}})
              for i, r in enumerate(rows)]
    return RoutingTable.from_points(key={"world_size": 2}, measured="2026-12-03T10:00:00Z",
                                    workload={"hidden": 7168}, measurements={("bfloat16", kind): points})


def book(t, shape=DEVICE):
    return RouteBook(TABLE, table=t, path="/cache/routes.json", shape=shape, limits=LIMITS)


def test_the_seeds_route_every_size_to_the_seed_route_of_the_workspace():
    seeds = RouteBook(SEEDS, shape=WorkspaceShape(8, "device", "pcie", num_islands=2, sm_budget=188), limits=LIMITS)
    assert seeds.source == SEEDS
    # resolved: the CTA cap and, for a plain call, the CTA size a launch uses are named
    assert seeds.route(2 * ROW, "bfloat16", False) == Route(Schedule.ISLAND, Transport.PUSH, "device", ctas=188,
                                                            threads=64)
    assert seeds.route(ROW, "float16", True) == Route(Schedule.ONESHOT, Transport.PUSH, "device", ctas=188)
    assert seeds.source_line() == ("routes: seeds, UNMEASURED on this box: every size within the bound goes to the "
                                   "sm120 kernels (--sm120-allreduce-tune off; python -m sglang_sm120.tune measures "
                                   "this box)")
    assert seeds.describe("bfloat16", ROW) == ""


def test_a_table_sends_the_sizes_nccl_won_to_nccl_and_the_others_to_the_launch_measured():
    b = book(table({"sm120/TWOSHOT/pull/device/b94": [10, 10, 30, 30]}))
    assert b.route(ROW, "bfloat16", False) == Route(Schedule.TWOSHOT, Transport.PULL, "device", ctas=94, threads=64)
    assert b.route(3 * ROW, "bfloat16", False) is None
    assert b.route(5 * ROW, "bfloat16", False) is None  # past what was measured
    assert b.route(ROW, "float16", False) is None and b.route(ROW, "bfloat16", True) is None
    assert b.source_line() == "routes: tuned table /cache/routes.json, measured 2026-12-03T10:00:00Z"
    assert b.describe("bfloat16", 4 * ROW).startswith("plain: TWOSHOT/pull/device/b94 up to 28672 B, NCCL up to "
                                                      "57344 B")


@pytest.mark.parametrize("cid, shape", [
    ("sm120/ONESHOT/push/device", WorkspaceShape(2, "host", "host", sm_budget=188)),  # another memory
    ("sm120/ISLAND/push/device", DEVICE),  # no islands here
    ("sm120/ONESHOT/push/device/b188", WorkspaceShape(2, "device", "pcie", sm_budget=94)),  # past the budget
    ("sm120/ONESHOT/push/device/t1024", DEVICE),  # wider CTAs than the plain kernels take
])
def test_routes_this_workspace_cannot_run_as_measured_go_to_nccl(cid, shape):
    assert book(table({cid: [10] * 4}), shape).route(ROW, "bfloat16", False) is None


def test_every_transport_runs_and_islands_run_where_the_workspace_has_them():
    assert book(table({"sm120/ONESHOT/staged/device": [10] * 4})).route(ROW, "bfloat16", False)
    islands = WorkspaceShape(8, "device", "pcie", num_islands=2, sm_budget=188)
    assert book(table({"sm120/ISLAND/pull/device": [10] * 4}), islands).route(ROW, "bfloat16", False)


def test_the_server_info_view():
    b = book(table({"sm120/ONESHOT/push/device": [10] * 4}))
    view = b.as_dict("bfloat16", 4 * ROW)
    assert view["source"] == "table" and view["path"] == "/cache/routes.json" and "ONESHOT" in view["routes"]
    assert RouteBook(SEEDS, why="no table", shape=DEVICE, limits=LIMITS).as_dict(None, 0) == {
        "source": "seeds", "line": RouteBook(SEEDS, shape=DEVICE, limits=LIMITS).source_line(), "why": "no table",
        "routes": "all sizes within the bound: seeds"}
    nccl = RouteBook(ALL_NCCL, why="no routing table of this box")
    assert nccl.as_dict("bfloat16", 4 * ROW) == {
        "source": "nccl", "why": "no routing table of this box", "routes": "all sizes: NCCL",
        "line": "routes: all NCCL because no routing table of this box (tune: python -m sglang_sm120.tune)"}


def test_all_nccl_routes_every_size_to_nccl():
    nccl = RouteBook(ALL_NCCL, why="why")
    assert all(nccl.route(n, d, f) is None for n in (16, ROW, 1 << 20) for d in ("bfloat16", "float16")
               for f in (False, True))


def test_a_cluster_size_the_workspace_does_not_launch_goes_to_nccl_not_to_another_launch():
    fused = table({"sm120/ONESHOT/push/device/c4": [10] * 4}, kind="fused")
    without = book(fused, WorkspaceShape(2, "device", "pcie", clusters=(2,), sm_budget=188))
    assert without.route(ROW, "bfloat16", True) is None
    with_four = book(fused, WorkspaceShape(2, "device", "pcie", clusters=(2, 4), sm_budget=188))
    assert route_id(with_four.route(ROW, "bfloat16", True)) == "sm120/ONESHOT/push/device/b188/c4"
    one = table({"sm120/ONESHOT/push/device/c1": [10] * 4}, kind="fused")
    assert book(one, WorkspaceShape(2, "device", "pcie", sm_budget=188)).route(ROW, "bfloat16", True)  # always


def test_a_book_that_routes_to_our_kernels_needs_what_the_workspace_runs():
    with pytest.raises(ValueError, match="shape"):
        RouteBook(TABLE, table=table({}), path="p")
