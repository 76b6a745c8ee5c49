"""The candidates the tuner times, what the installed kernels offer, and how a route becomes a call."""

from __future__ import annotations

import enum

import pytest

from sgl_kernel_sm120.variants import Variant
from sglang_sm120.routing.table import Route
from sglang_sm120.tuning import candidates as cand
from sglang_sm120.tuning.candidates import GroupShape, KernelOffer

ROW = 7168 * 2
PUSH_ONLY = KernelOffer(("push",))
ALL = KernelOffer(("push", "staged", "pull"), call_transport=True, ctor_transport=True)


def ids(routes):
    return [r.id for r in routes]


def test_two_ranks_time_the_one_shot_only():
    routes, skipped = cand.candidates("plain", ROW, 7168, GroupShape(2, "device"), PUSH_ONLY, quick=False)
    assert ids(routes) == ["sm120/ONESHOT/push/device"]
    assert skipped == {"sm120/ONESHOT/staged/device": cand.NOT_IN_BUILD, "sm120/ONESHOT/pull/device": cand.NOT_IN_BUILD}


def test_eight_ranks_with_islands_time_every_variant_over_every_offered_transport():
    routes, skipped = cand.candidates("plain", ROW, 7168, GroupShape(8, "device", num_islands=2), ALL, quick=True)
    assert ids(routes) == [f"sm120/{v}/{t}/device" for v in ("ONESHOT", "TWOSHOT", "ISLAND")
                           for t in ("push", "staged", "pull")]
    assert skipped == {}


def test_host_memory_pushes_only_has_no_islands_and_bounds_the_one_shot():
    shape = GroupShape(8, "host", num_islands=2, oneshot_max_bytes=8192)
    routes, skipped = cand.candidates("plain", ROW, 7168, shape, ALL, quick=True)
    assert ids(routes) == ["sm120/TWOSHOT/push/host"] and skipped == {}
    routes, _ = cand.candidates("plain", 4096, 7168, shape, ALL, quick=True)
    assert ids(routes) == ["sm120/ONESHOT/push/host", "sm120/TWOSHOT/push/host"]


def test_the_quick_tune_too_times_the_fused_one_shot_per_agreed_cluster():
    shape = GroupShape(4, "device", clusters=(2, 8))
    for quick in (False, True):
        routes, _ = cand.candidates("fused", 3 * ROW, 7168, shape, PUSH_ONLY, quick=quick)
        assert ids(routes) == ["sm120/ONESHOT/push/device/c1", "sm120/ONESHOT/push/device/c2",
                               "sm120/ONESHOT/push/device/c8", "sm120/TWOSHOT/push/device"]


BLOCKS = KernelOffer(("push", "staged", "pull"), call_transport=True, ctor_transport=True, call_cluster=True,
                     call_blocks=True)
RTX = GroupShape(8, "device", clusters=(2, 4, 8), sm_budget=188, staged_ctas=8)


def test_every_tuned_route_names_its_ctas_and_the_fused_one_shot_its_cluster():
    for kind in ("plain", "fused"):
        for rows in (1, 4, 16, 128):
            routes, _ = cand.candidates(kind, rows * ROW, 7168, RTX, BLOCKS, quick=True)
            assert routes and all(r.ctas is not None for r in routes), (kind, rows)
            assert all((r.cluster is not None) == (kind == "fused" and r.variant == "ONESHOT") for r in routes)
            assert all(Route.parse(r.id) == r for r in routes)


def test_staged_push_is_tried_at_its_own_cap_and_on_the_whole_budget():
    routes, _ = cand.candidates("plain", 128 * ROW, 7168, RTX, BLOCKS, quick=True)
    staged = sorted(r.ctas for r in routes if r.transport == "staged" and r.variant == "ONESHOT")
    assert staged == [8, 188]
    pushed = sorted(r.ctas for r in routes if r.transport == "push" and r.variant == "ONESHOT")
    assert pushed == [94, 188]
    full, _ = cand.candidates("plain", 128 * ROW, 7168, RTX, BLOCKS, quick=False)
    assert sorted(r.ctas for r in full if r.transport == "staged" and r.variant == "ONESHOT") == [8, 16, 32, 94, 188]
    assert sorted(r.ctas for r in full if r.transport == "push" and r.variant == "ONESHOT") == [47, 94, 188]


def test_caps_that_launch_the_same_grid_are_timed_once_keeping_the_largest():
    # one row of 7168 bf16 is 896 packs: 4 CTAs of 256 threads whatever the cap above that
    routes, _ = cand.candidates("plain", ROW, 7168, RTX, BLOCKS, quick=True)
    assert sorted(r.ctas for r in routes if r.transport == "push" and r.variant == "ONESHOT") == [188]
    assert sorted(r.ctas for r in routes if r.transport == "staged" and r.variant == "ONESHOT") == [188]
    assert cand.plain_grid(ROW, 188) == 4 and cand.plain_grid(128 * ROW, 94) == 94


def test_the_fused_one_shot_times_every_agreed_cluster_whose_rows_all_fit_at_once():
    def shapes(rows):
        routes, _ = cand.candidates("fused", rows * ROW, 7168, RTX, BLOCKS, quick=True)
        return sorted((r.cluster, r.ctas) for r in routes if r.variant == "ONESHOT" and r.transport == "push")

    assert shapes(1) == [(1, 188), (2, 188), (4, 188), (8, 188)]
    assert shapes(16) == [(1, 188), (2, 188), (4, 188), (8, 188)]  # 8 x 16 rows do not fit 94 CTAs
    assert shapes(32) == [(1, 188), (2, 188), (4, 188)]
    assert shapes(128) == [(1, 94), (1, 188)]
    no_clusters = GroupShape(8, "device", clusters=(), sm_budget=188)
    routes, _ = cand.candidates("fused", ROW, 7168, no_clusters, BLOCKS, quick=True)
    assert {r.cluster for r in routes if r.variant == "ONESHOT"} == {1}


def test_without_blocks_in_the_build_no_cta_count_is_tuned():
    routes, _ = cand.candidates("plain", 128 * ROW, 7168, RTX, ALL, quick=True)
    assert routes and all(r.ctas is None for r in routes)


def test_sizes_the_kernels_cannot_take_have_no_candidates():
    shape = GroupShape(2, "device")
    assert cand.candidates("plain", 24, 7168, shape, PUSH_ONLY, quick=True) == ([], {})
    assert cand.candidates("fused", ROW + 16, 7168, shape, PUSH_ONLY, quick=True) == ([], {})
    assert cand.candidates("fused", 2 * 70000 * 2, 70000, shape, PUSH_ONLY, quick=True) == ([], {})
    with pytest.raises(ValueError):
        cand.candidates("both", ROW, 7168, shape, PUSH_ONLY, quick=True)


class Transport(str, enum.Enum):
    PUSH = "push"
    STAGED = "staged"
    PULL = "pull"


class TodaysKernel:
    def __init__(self, group, device, max_numel, dtype=None, *, islands=None, memory="device", on_timeout="trap"):
        pass

    def all_reduce(self, inp, out=None, *, variant=None):
        pass

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out=None, residual_out=None, *, variant=None):
        pass


class Issue17Kernel(TodaysKernel):
    def __init__(self, group, device, max_numel, dtype=None, *, transport="auto", **kwargs):
        pass

    def all_reduce(self, inp, out=None, *, variant=None, transport=None):
        pass

    def all_reduce_add_rmsnorm(self, inp, residual, weight, eps, norm_out=None, residual_out=None, *, variant=None,
                               transport=None, cluster=None):
        pass


def test_todays_kernels_offer_push_only():
    assert cand.detect_offer(TodaysKernel, None) == KernelOffer(("push",), False, False, False, False)
    # the enum alone is not enough: the calls must take transport=
    assert cand.detect_offer(TodaysKernel, Transport) == KernelOffer(("push",), False, False, False, False)


def test_the_transports_of_issue_17_are_found_by_their_enum_and_signatures():
    assert cand.detect_offer(Issue17Kernel, Transport) == KernelOffer(("push", "staged", "pull"), True, True, True)


def test_the_installed_kernel_package_is_detected_without_error():
    offer = cand.detect_offer()
    assert "push" in offer.transports
    assert offer.call_blocks and offer.call_cluster  # this repository's IpcAllReduce takes both per call


def test_a_route_with_ctas_runs_them_or_is_not_servable():
    route = Route("sm120", "ONESHOT", "staged", "device", None, 188)
    assert cand.call_kwargs(route, BLOCKS)["blocks"] == 188
    with pytest.raises(ValueError, match="not available in this build"):
        cand.call_kwargs(route, ALL)


def test_the_group_offers_what_every_rank_offers():
    offers = [ALL, KernelOffer(("push", "pull"), True, False, False)]
    assert cand.agree_offer(offers) == KernelOffer(("push", "pull"), True, False, False)


def test_a_route_becomes_the_variant_and_where_taken_the_transport():
    route = Route("sm120", "TWOSHOT", "push", "device")
    assert cand.call_kwargs(route, PUSH_ONLY) == {"variant": Variant.TWOSHOT}
    kwargs = cand.call_kwargs(Route("sm120", "ONESHOT", "pull", "device"), ALL)
    assert kwargs["variant"] is Variant.ONESHOT and kwargs["transport"] == "pull"
    with pytest.raises(ValueError, match="not available in this build"):
        cand.call_kwargs(Route("sm120", "ONESHOT", "pull", "device"), PUSH_ONLY)
    with pytest.raises(ValueError):
        cand.call_kwargs(Route("nccl"), PUSH_ONLY)


def test_the_fused_cluster_goes_on_the_workspace_unless_the_call_takes_it():
    class Workspace:
        fused_cluster = None

    ws, route = Workspace(), Route("sm120", "ONESHOT", "push", "device", 4)
    assert cand.apply_cluster(ws, route, PUSH_ONLY, {"variant": 0}) == {"variant": 0} and ws.fused_cluster == 4
    ws = Workspace()
    taking = KernelOffer(("push",), call_cluster=True)
    assert cand.apply_cluster(ws, route, taking, {}) == {"cluster": 4} and ws.fused_cluster is None
