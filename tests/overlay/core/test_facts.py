"""What a rank reports of itself, with torch.cuda stood in (no GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_sm120.core import facts


@pytest.fixture
def two_gpus(monkeypatch):
    def props(index):
        return types.SimpleNamespace(major=12, minor=0, uuid=f"uuid-{index}", name="RTX PRO 6000",
                                     pci_domain_id=0, pci_bus_id=0x41 + index, pci_device_id=0)

    cuda = torch.cuda
    for name, value in {"is_available": lambda: True, "device_count": lambda: 2, "current_device": lambda: 1,
                        "get_device_properties": props, "can_device_access_peer": lambda a, b: False}.items():
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(facts, "kernel_error", lambda: None)
    monkeypatch.setenv("NCCL_P2P_LEVEL", "SYS")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")


def test_an_sm120_rank_reports_its_gpu_its_peers_and_its_part_of_the_key(two_gpus):
    found = facts.local_facts(types.SimpleNamespace(type="cuda", index=None), "auto")
    assert found["capability"] == [12, 0] and found["uuid"] == "GPU-uuid-1" and found["name"] == "RTX PRO 6000"
    assert found["p2p"] == {"GPU-uuid-0": False, "GPU-uuid-1": True}  # the current device, 1, reaches itself
    key = found["key"]
    assert key["uuid"] == "GPU-uuid-1" and key["pci_bus_id"] == "00000000:42:00.0" and key["nccl"] == "2.27.3"
    assert key["nccl_settings"] == {"NCCL_P2P_LEVEL": "SYS"}  # where NCCL logs is no part of the key
    assert "probe_error" not in found


def test_auto_mode_on_another_gpu_looks_no_further(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(major=9, minor=0, uuid="GPU-h", name="H100"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    found = facts.local_facts(types.SimpleNamespace(type="cuda", index=0), "auto")
    assert found["capability"] == [9, 0] and found["p2p"] is None and found["key"] is None
    forced = facts.local_facts(types.SimpleNamespace(type="cuda", index=0), "on")
    assert forced["p2p"] == {"GPU-h": True} and forced["key"]["pci_bus_id"] is None  # no PCI fields on this torch


def test_a_failing_probe_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: 1 / 0)
    found = facts.local_facts(types.SimpleNamespace(type="cuda", index=0), "on")
    assert found["probe_error"].startswith("ZeroDivisionError") and found["capability"] is None
