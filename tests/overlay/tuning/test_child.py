"""A tune rank's workspace construction, without a GPU: the workspace is built on the gloo group the rank's
gather runs over, and every rank's outcome is agreed through that gather."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

import sgl_kernel_sm120
from sglang_sm120.tuning import child

SPEC = types.SimpleNamespace(max_rows=16, hidden=7168, kernel_timeout_s=30.0)
CHOSEN = types.SimpleNamespace(islands=None, link="pcie", memory="device")


@pytest.fixture
def one_rank_gather(monkeypatch):
    def all_gather_object(out, obj, group=None):
        assert group == "the tune's gloo group"
        out[:] = [obj]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    return child._Gather("the tune's gloo group", 1)


def test_the_workspace_is_built_on_the_gather_s_group(monkeypatch, one_rank_gather):
    made = []

    class Workspace:
        def __init__(self, group, device, max_numel, dtype, **kwargs):
            made.append((group, max_numel, kwargs["memory"]))

    monkeypatch.setattr(sgl_kernel_sm120, "IpcAllReduce", Workspace, raising=False)
    workspace, failed = child._construct(one_rank_gather, "cuda:0", SPEC, CHOSEN)
    assert isinstance(workspace, Workspace) and failed == {}
    assert made == [("the tune's gloo group", 16 * 7168, "device")]


def test_a_failed_construction_is_agreed_as_that_rank_s_failure(monkeypatch, one_rank_gather):
    class Workspace:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("no room for the workspace")

    monkeypatch.setattr(sgl_kernel_sm120, "IpcAllReduce", Workspace, raising=False)
    workspace, failed = child._construct(one_rank_gather, "cuda:0", SPEC, CHOSEN)
    assert workspace is None and list(failed) == [0]
    assert "no room for the workspace" in failed[0]["error"]
