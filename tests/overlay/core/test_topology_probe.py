"""The NVML probe and the doctor's printouts, against a stand-in pynvml (no GPU)."""

from __future__ import annotations

import os
import pathlib
import sys
import types

import pytest

from sglang_sm120.core import topology

UUIDS = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]


def fake_nvml(*, fail_init=False, fail_pair=None, numa=(0, 0, 1, 1), nvlink=True, sysfs_numa=False):
    calls = {"shutdown": 0}

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("no driver")

    def ancestor(a, b):
        if {a, b} == fail_pair:
            raise NVMLError("not supported")
        return 40 if a // 2 == b // 2 else 50

    def numa_node(h):
        if sysfs_numa:
            raise NVMLError("old driver")
        return numa[h]

    def p2p(a, b, index):
        assert index == "NVLINK"
        return "OK" if nvlink else "NS"

    def shutdown():
        calls["shutdown"] += 1

    return calls, types.SimpleNamespace(
        nvmlInit=init, nvmlShutdown=shutdown, nvmlDeviceGetHandleByUUID=UUIDS.index,
        nvmlDeviceGetTopologyCommonAncestor=ancestor, nvmlDeviceGetNumaNodeId=numa_node,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"00000000:{h + 1:02X}:00.0".encode()),
        nvmlDeviceGetP2PStatus=p2p, NVML_P2P_CAPS_INDEX_NVLINK="NVLINK", NVML_P2P_STATUS_OK="OK",
        nvmlDeviceGetCpuAffinity=lambda h, words: [0b1111 | (1 << 63), 0b11] + [0] * (words - 2))


@pytest.fixture
def nvml(monkeypatch):
    def install(**kwargs):
        calls, module = fake_nvml(**kwargs)
        monkeypatch.setitem(sys.modules, "pynvml", module)
        monkeypatch.setattr(os, "cpu_count", lambda: 128)
        return calls

    return install


def test_the_probe_reads_levels_numa_bus_ids_and_nvlink(nvml):
    calls = nvml()
    topo = topology.probe(UUIDS)
    assert topo.error is None and calls["shutdown"] == 1
    assert topo.levels == [[0, 40, 50, 50], [40, 0, 50, 50], [50, 50, 0, 40], [50, 50, 40, 0]]
    assert topo.numa_nodes == [0, 0, 1, 1]
    assert topo.nvlink_all_pairs is True and topo.link == "nvlink"
    assert topo.islands() == [[0, 1], [2, 3]]


def test_an_unanswered_pair_is_unknown_and_no_nvlink_is_pcie(nvml):
    nvml(fail_pair={0, 3}, nvlink=False)
    topo = topology.probe(UUIDS)
    assert topo.levels[0][3] is None and topo.levels[3][0] is None and topo.levels[0][1] == 40
    assert topo.nvlink_all_pairs is False and topo.link == "pcie"
    assert topo.islands() == [[0, 1], [2, 3]]  # the NUMA nodes decide


def test_without_nvml_everything_is_unknown(nvml):
    nvml(fail_init=True)
    topo = topology.probe(UUIDS)
    assert topo.error.startswith("NVML unavailable") and topo.levels is None and topo.link == "auto"
    assert topo.numa_nodes == [None] * 4 and topology.cpu_affinity("GPU-a") is None


def test_an_old_driver_falls_back_to_sysfs_for_the_numa_node(nvml, monkeypatch):
    nvml(sysfs_numa=True)
    opened = []
    monkeypatch.setattr(pathlib.Path, "read_text", lambda path, *a, **k: opened.append(str(path)) or "1\n")
    topo = topology.probe(UUIDS[:2])
    assert topo.numa_nodes == [1, 1] and opened[0] == "/sys/bus/pci/devices/0000:01:00.0/numa_node"


def test_the_doctors_printouts(nvml):
    nvml()
    assert topology.cpu_affinity("GPU-a") == "0-3,63-65"
    assert topology.format_levels(None, []) == "(unknown)"
    assert topology.format_levels([[0, 10], [None, 0]], ["cuda:0", "cuda:1"]).splitlines() == [
        "      cuda:0cuda:1",
        "cuda:0     X   PIX",
        "cuda:1     ?     X"]
    assert topology.format_levels([[0, 50], [50, 0]], ["a", "b"]).splitlines()[2] == "     b   SYS     X"
