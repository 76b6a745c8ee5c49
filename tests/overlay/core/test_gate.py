"""The capability gate: a pure function of gathered facts."""

from __future__ import annotations

import itertools

import pytest

from sglang_sm120.core import gate
from sglang_sm120.core.gate import decide

CAPS = {"sm120": (12, 0), "sm121": (12, 1), "hopper": (9, 0), "blackwell_dc": (10, 0)}


def full_p2p(n):
    return [[True] * n for _ in range(n)]


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
@pytest.mark.parametrize("cap_name", sorted(CAPS))
@pytest.mark.parametrize("world", range(1, 9))
def test_capability_world_mode_matrix(mode, cap_name, world):
    cap = CAPS[cap_name]
    decision = decide(mode, [cap] * world, world, 1, full_p2p(world), False, [None] * world)
    world_ok = world in (2, 4, 8)
    if mode == "off":
        expected = False
    elif mode == "on":
        expected = world_ok
    else:
        expected = world_ok and cap == (12, 0)
    assert decision.enabled is expected, decision.reason
    assert decision.reason


def test_auto_names_sm121_explicitly():
    decision = decide("auto", [(12, 1)] * 8, 8, 1, full_p2p(8), False)
    assert not decision.enabled
    assert "12.1" in decision.reason


def test_mixed_capabilities_name_the_ranks():
    caps = [(12, 0)] * 7 + [(9, 0)]
    decision = decide("auto", caps, 8, 1, full_p2p(8), False)
    assert not decision.enabled
    assert "[7]" in decision.reason and "9.0" in decision.reason
    assert decide("on", caps, 8, 1, full_p2p(8), False).enabled


@pytest.mark.parametrize("mode,expected", [("auto", False), ("on", True)])
def test_deterministic(mode, expected):
    decision = decide(mode, [(12, 0)] * 4, 4, 1, full_p2p(4), True)
    assert decision.enabled is expected
    assert "deterministic" in decision.reason


@pytest.mark.parametrize("mode", ["auto", "on"])
@pytest.mark.parametrize("nnodes", [2, 4])
def test_multi_node_is_refused(mode, nnodes):
    decision = decide(mode, [(12, 0)] * 8, 8, nnodes, full_p2p(8), False)
    assert not decision.enabled
    assert "nodes" in decision.reason


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_missing_p2p_pair_selects_host_memory_and_names_the_pair(mode):
    p2p = full_p2p(8)
    p2p[3][5] = False
    names = ["NVIDIA RTX PRO 6000 Blackwell Workstation Edition"] * 8
    decision = decide(mode, [(12, 0)] * 8, 8, 1, p2p, False, [None] * 8, names=names)
    assert decision.enabled and decision.memory == "host", decision
    assert "3->5" in decision.reason and "host memory" in decision.reason, decision.reason
    assert "IOMMU" in decision.reason and "GeForce" not in decision.reason, decision.reason


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_missing_p2p_with_hostmem_off_is_refused_and_says_why(mode):
    p2p = full_p2p(8)
    p2p[3][5] = False
    decision = decide(mode, [(12, 0)] * 8, 8, 1, p2p, False, [None] * 8, hostmem="off")
    assert not decision.enabled
    assert "3->5" in decision.reason and "SGLANG_SM120_HOSTMEM=off" in decision.reason, decision.reason
    # with every pair connected, hostmem off changes nothing
    assert decide(mode, [(12, 0)] * 8, 8, 1, full_p2p(8), False, hostmem="off") == decide(
        mode, [(12, 0)] * 8, 8, 1, full_p2p(8), False)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_full_p2p_selects_device_memory(mode):
    decision = decide(mode, [(12, 0)] * 4, 4, 1, full_p2p(4), False, [None] * 4)
    assert decision.enabled and decision.memory == "device", decision


def test_mode_on_without_p2p_on_other_gpus_selects_host_memory():
    no_p2p = [[i == j for j in range(4)] for i in range(4)]
    decision = decide("on", [(9, 0)] * 4, 4, 1, no_p2p, False, [None] * 4, names=["NVIDIA H100 PCIe"] * 4)
    assert decision.enabled and decision.memory == "host", decision
    assert "mode on" in decision.reason and "0->1" in decision.reason, decision.reason
    # auto still wants capability 12.0 first
    assert not decide("auto", [(9, 0)] * 4, 4, 1, no_p2p, False, [None] * 4).enabled


@pytest.mark.parametrize("mode", ["auto", "on"])
@pytest.mark.parametrize("hostmem", ["auto", "off"])
def test_multi_node_without_p2p_is_refused(mode, hostmem):
    no_p2p = [[i == j for j in range(8)] for i in range(8)]
    decision = decide(mode, [(12, 0)] * 8, 8, 2, no_p2p, False, [None] * 8, hostmem=hostmem)
    assert not decision.enabled and "nodes" in decision.reason, decision.reason


def test_host_memory_still_needs_the_kernels_and_world_size():
    no_p2p = [[i == j for j in range(2)] for i in range(2)]
    decision = decide("auto", [(12, 0)] * 2, 2, 1, no_p2p, False, [None, "not built"])
    assert not decision.enabled and "not built" in decision.reason, decision.reason
    no_p2p3 = [[i == j for j in range(3)] for i in range(3)]
    assert not decide("on", [(12, 0)] * 3, 3, 1, no_p2p3, False, [None] * 3).enabled
    assert not decide("auto", [(12, 0)] * 2, 2, 1, no_p2p, True, [None] * 2).enabled  # deterministic


def test_unknown_hostmem_raises():
    with pytest.raises(ValueError, match="hostmem"):
        decide("auto", [(12, 0)] * 2, 2, 1, full_p2p(2), False, hostmem="on")


def test_unprobed_p2p_is_refused():
    assert not decide("on", [(9, 0)] * 2, 2, 1, None, False).enabled


def test_no_cuda_device_on_a_rank():
    decision = decide("on", [(12, 0), None], 2, 1, full_p2p(2), False)
    assert not decision.enabled and "CUDA" in decision.reason


def test_kernels_missing_on_a_rank():
    decision = decide("auto", [(12, 0)] * 2, 2, 1, full_p2p(2), False, [None, "not built"])
    assert not decision.enabled
    assert "[1]" in decision.reason and "not built" in decision.reason


def test_modes_must_agree():
    decision = decide("auto", [(12, 0)] * 2, 2, 1, full_p2p(2), False, modes=["auto", "on"])
    assert not decision.enabled and "disagree" in decision.reason


def test_facts_from_too_few_ranks():
    assert not decide("on", [(12, 0)], 2, 1, full_p2p(2), False).enabled


def test_every_enabled_decision_has_a_reason():
    for mode, world in itertools.product(("auto", "on"), (2, 4, 8)):
        decision = decide(mode, [(12, 0)] * world, world, 1, full_p2p(world), False)
        assert decision.enabled and "P2P" in decision.reason


def test_unknown_mode_raises():
    with pytest.raises(ValueError):
        decide("maybe", [(12, 0)] * 2, 2, 1, full_p2p(2), False)


def test_geforce_without_p2p_uses_host_memory_and_names_the_driver_policy():
    no_p2p = [[True, False], [False, True]]
    decision = gate.decide("auto", [(12, 0), (12, 0)], 2, 1, no_p2p, False, [None, None],
                           names=["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 5090"])
    assert decision.enabled and decision.memory == "host", decision
    assert "NVIDIA GeForce RTX 5090" in decision.reason and "disables P2P" in decision.reason, decision.reason
    assert "policy" in decision.reason and "0->1" in decision.reason, decision.reason
    assert "IOMMU" not in decision.reason and "host memory" in decision.reason, decision.reason
    refused = gate.decide("auto", [(12, 0), (12, 0)], 2, 1, no_p2p, False, [None, None],
                          names=["NVIDIA GeForce RTX 5090"] * 2, hostmem="off")
    assert not refused.enabled and "GeForce" in refused.reason and "SGLANG_SM120_HOSTMEM=off" in refused.reason
    workstation = gate.decide("auto", [(12, 0), (12, 0)], 2, 1, no_p2p, False,
                              names=["NVIDIA RTX PRO 6000 Blackwell Workstation Edition"] * 2)
    assert workstation.enabled and workstation.memory == "host"
    assert "IOMMU" in workstation.reason and "GeForce" not in workstation.reason, workstation.reason
