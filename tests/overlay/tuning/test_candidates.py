"""The candidates the tuner times: which variants and transports, and which launch shapes of each."""

from __future__ import annotations

import pytest

from sgl_kernel_sm120 import policy
from sgl_kernel_sm120.policy import Route, WorkspaceShape, kernel_limits, plain_grid, refusal
from sglang_sm120.routing.table import parse_route, route_id
from sglang_sm120.tuning import candidates as cand

ROW = 7168 * 2
LIMITS = kernel_limits()


def ids(routes):
    return [route_id(r) for r in routes]


def shape(world, memory="device", **kw):
    return WorkspaceShape(world, memory, "host" if memory == "host" else "pcie", **kw)


def test_two_ranks_time_the_one_shot_over_every_transport():
    routes = cand.candidates("plain", ROW, 7168, shape(2), LIMITS, quick=False)
    assert ids(routes) == ["sm120/ONESHOT/push/device", "sm120/ONESHOT/staged/device/w1", "sm120/ONESHOT/pull/device"]


def test_eight_ranks_with_islands_time_every_variant_over_every_transport():
    routes = cand.candidates("plain", ROW, 7168, shape(8, num_islands=2), LIMITS, quick=True)
    assert ids(routes) == [f"sm120/{v}/{t}/device{w}" for v in ("ONESHOT", "TWOSHOT", "ISLAND")
                           for t in ("push", "staged", "pull")
                           for w in (("/w1", "/w7") if t == "staged" else ("",))]


def test_host_memory_pushes_only_has_no_islands_and_bounds_the_one_shot():
    host = shape(8, "host", num_islands=2, oneshot_max_bytes=8192)
    assert ids(cand.candidates("plain", ROW, 7168, host, LIMITS, quick=True)) == ["sm120/TWOSHOT/push/host"]
    assert ids(cand.candidates("plain", 4096, 7168, host, LIMITS, quick=True)) == [
        "sm120/ONESHOT/push/host", "sm120/TWOSHOT/push/host"]


def test_the_quick_tune_too_times_the_fused_one_shot_per_agreed_cluster():
    four = shape(4, clusters=(2, 8))
    for quick in (False, True):
        routes = cand.candidates("fused", 3 * ROW, 7168, four, LIMITS, quick=quick)
        pushed = [r for r in ids(routes) if "/push/" in r]
        assert pushed == ["sm120/ONESHOT/push/device/c1", "sm120/ONESHOT/push/device/c2",
                          "sm120/ONESHOT/push/device/c8", "sm120/TWOSHOT/push/device"]


RTX = shape(8, clusters=(2, 4, 8), sm_budget=188)


def test_every_tuned_route_names_its_ctas_and_the_fused_one_shot_its_cluster_and_runs_as_named():
    for kind in ("plain", "fused"):
        for rows in (1, 4, 16, 128):
            routes = cand.candidates(kind, rows * ROW, 7168, RTX, LIMITS, quick=True)
            assert routes and all(r.ctas is not None for r in routes), (kind, rows)
            assert all((r.cluster is not None) == (kind == "fused" and r.schedule.name == "ONESHOT") for r in routes)
            assert all(parse_route(route_id(r)) == r for r in routes)
            assert all(refusal(RTX, r, rows * ROW, fused=kind == "fused", limits=LIMITS) is None for r in routes)


def test_staged_push_is_tried_at_its_own_cap_and_on_the_whole_budget_each_in_a_window_of_one_and_of_every_pass():
    routes = cand.candidates("plain", 128 * ROW, 7168, RTX, LIMITS, quick=True)
    one = [r for r in routes if r.schedule.name == "ONESHOT"]
    assert sorted((r.ctas, r.window) for r in one if r.transport.value == "staged") == [
        (8, 1), (8, 7), (188, 1), (188, 7)]
    assert sorted(r.ctas for r in one if r.transport.value == "push") == [94, 188]
    assert all(r.window is None for r in one if r.transport.value != "staged")
    full = [r for r in cand.candidates("plain", 128 * ROW, 7168, RTX, LIMITS, quick=False)
            if r.schedule.name == "ONESHOT"]
    assert sorted({r.ctas for r in full if r.transport.value == "staged"}) == [8, 16, 32, 94, 188]
    assert sorted({r.window for r in full if r.transport.value == "staged"}) == [1, 2, 7]
    assert sorted((r.ctas, r.threads) for r in full if r.transport.value == "push") == [
        (47, 512), (94, 512), (188, 64), (188, 128), (188, 256), (188, 512)]


def test_caps_that_launch_the_same_grid_are_timed_once_keeping_the_largest():
    # one row of 7168 bf16 is 896 packs: 4 CTAs of 256 threads whatever the cap above that
    routes = [r for r in cand.candidates("plain", ROW, 7168, RTX, LIMITS, quick=True) if r.schedule.name == "ONESHOT"]
    assert sorted(r.ctas for r in routes if r.transport.value == "staged") == [188, 188]  # windows 1 and 7
    assert plain_grid(ROW, 188, 256, LIMITS) == 4 and plain_grid(128 * ROW, 94, 512, LIMITS) == 94
    # push at 64 threads: 14 CTAs, which the cap of 94 launches as well; the budget's route stays
    assert sorted((r.ctas, r.threads) for r in routes if r.transport.value == "push") == [
        (188, 64), (188, 128), (188, 256)]


def test_the_plain_kernels_cta_size_is_tuned_on_the_whole_budget():
    for rows, seed in ((1, 64), (16, 128), (128, 512)):
        routes = cand.candidates("plain", rows * ROW, 7168, RTX, LIMITS, quick=True)
        one = [r for r in routes if r.schedule.name == "ONESHOT"]
        assert all(r.threads is not None for r in routes)  # every plain route names its CTA size
        quick = sorted({r.threads for r in one if r.transport.value == "pull" and r.ctas == 188})
        assert quick == [t for t in (seed, 2 * seed, 4 * seed) if t <= LIMITS.plain_max_threads], (rows, quick)
        assert {r.threads for r in one if r.transport.value == "staged" and r.ctas == 188} == {
            256 if rows < 128 else 512}
        # at its few-CTA cap staged push's CTAs are larger, so that one wave holds the call (policy.plain_threads)
        assert all(r.threads == policy.plain_threads(rows * ROW, "staged", ctas=8, limits=LIMITS)
                   for r in one if r.transport.value == "staged" and r.ctas == 8)
        assert all(r.threads == seed for r in one if r.ctas < 188 and r.transport.value != "staged")
        full = cand.candidates("plain", rows * ROW, 7168, RTX, LIMITS, quick=False)
        assert {r.threads for r in full if r.ctas == 188} == {64, 128, 256, 512}


def test_the_fused_one_shot_times_every_agreed_cluster_whose_rows_all_fit_at_once():
    def shapes(rows):
        routes = cand.candidates("fused", rows * ROW, 7168, RTX, LIMITS, quick=True)
        return sorted((r.cluster, r.ctas) for r in routes
                      if r.schedule.name == "ONESHOT" and r.transport.value == "push")

    assert shapes(1) == [(1, 188), (2, 188), (4, 188), (8, 188)]
    assert shapes(16) == [(1, 188), (2, 188), (4, 188), (8, 188)]  # 8 x 16 rows do not fit 94 CTAs
    assert shapes(32) == [(1, 188), (2, 188), (4, 188)]
    assert shapes(128) == [(1, 94), (1, 188)]
    routes = cand.candidates("fused", ROW, 7168, shape(8, sm_budget=188), LIMITS, quick=True)
    assert {r.cluster for r in routes if r.schedule.name == "ONESHOT"} == {1}


def test_without_a_known_budget_no_cta_count_is_tuned():
    routes = cand.candidates("plain", 128 * ROW, 7168, shape(8), LIMITS, quick=True)
    assert routes and all(r.ctas is None for r in routes)


def test_sizes_the_kernels_cannot_take_have_no_candidates():
    two = shape(2)
    assert cand.candidates("plain", 24, 7168, two, LIMITS, quick=True) == []
    assert cand.candidates("fused", ROW + 16, 7168, two, LIMITS, quick=True) == []
    wide = LIMITS.max_fused_hidden + LIMITS.elems_per_pack  # one pack wider than the fused kernels take
    assert cand.candidates("fused", 2 * wide * 2, wide, two, LIMITS, quick=True) == []
    assert cand.candidates("fused", 2 * LIMITS.max_fused_hidden * 2, LIMITS.max_fused_hidden, two, LIMITS,
                           quick=True)
    with pytest.raises(ValueError):
        cand.candidates("both", ROW, 7168, two, LIMITS, quick=True)


def test_a_candidate_is_a_route_of_the_policy_and_nothing_else():
    route = cand.candidates("plain", ROW, 7168, RTX, LIMITS, quick=True)[0]
    assert isinstance(route, Route) and route.memory.value == "device"
