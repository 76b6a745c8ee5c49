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


def test_a_full_tune_times_the_fused_one_shot_per_agreed_cluster_and_a_quick_one_by_the_kernels_rule():
    shape = GroupShape(4, "device", clusters=(2, 8))
    full, _ = cand.candidates("fused", 3 * ROW, 7168, shape, PUSH_ONLY, quick=False)
    assert ids(full) == ["sm120/ONESHOT/push/device/c1", "sm120/ONESHOT/push/device/c2",
                         "sm120/ONESHOT/push/device/c8", "sm120/TWOSHOT/push/device"]
    quick, _ = cand.candidates("fused", 3 * ROW, 7168, shape, PUSH_ONLY, quick=True)
    assert ids(quick) == ["sm120/ONESHOT/push/device", "sm120/TWOSHOT/push/device"]


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
    assert cand.detect_offer(TodaysKernel, None) == KernelOffer(("push",), False, False, False)
    # the enum alone is not enough: the calls must take transport=
    assert cand.detect_offer(TodaysKernel, Transport) == KernelOffer(("push",), False, False, False)


def test_the_transports_of_issue_17_are_found_by_their_enum_and_signatures():
    assert cand.detect_offer(Issue17Kernel, Transport) == KernelOffer(("push", "staged", "pull"), True, True, True)


def test_the_installed_kernel_package_is_detected_without_error():
    offer = cand.detect_offer()
    assert "push" in offer.transports


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
