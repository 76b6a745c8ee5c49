"""A steady-state eager call through the hooks allocates nothing but its outputs and imports nothing: the plain
all-reduce and the fused layer boundary of benchmarks/bench_hot_path.py (the real hooks, backend and workspace
object; the compiled ops stood in)."""

from __future__ import annotations

import builtins

import pytest
import torch

from benchmarks import bench_hot_path


def _refuse(name):
    def refused(*args, **kwargs):
        raise AssertionError(f"torch.{name} ran in a steady-state call")

    return refused


@pytest.mark.parametrize("which", ["plain", "fused boundary"])
def test_a_steady_state_call_makes_no_allocation_but_its_outputs_and_no_import(monkeypatch, which):
    plain, boundary = bench_hot_path.build(monkeypatch.setattr)
    call = plain if which == "plain" else boundary
    call()  # the first call of a size fills the route memo
    imports = []
    real_import = builtins.__import__

    def counting_import(name, *args, **kwargs):
        imports.append(name)
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as m:
        for name in ("empty", "zeros", "ones", "full", "tensor"):
            m.setattr(torch, name, _refuse(name))
        m.setattr(builtins, "__import__", counting_import)  # last: monkeypatch's own setattr imports
        for _ in range(3):
            call()
    assert imports == []


def test_the_stand_in_workspace_really_serves_both_calls(monkeypatch):
    """The check above means something only if the calls reach the launch (a declined call would take SGLang's
    path, which the stand-in `original` refuses) and are counted there."""
    from sglang_sm120.runtime.registry import group_backend

    plain, boundary = bench_hot_path.build(monkeypatch.setattr)
    from sglang_sm120.hooks.distributed import sglang_group

    plain()
    boundary()
    stats = group_backend(sglang_group("tp_group")).stats
    assert stats == {"sm120": 1, "sm120_fused": 1, "fallback": 0, "fused_fallback": 0}


def test_the_fused_boundary_runs_at_most_ten_predicates_of_ours(monkeypatch):
    """The norm's ask and the claimed call it promised: the overlay's own conditional jumps (the kernel package's
    launch and torch's are its own business). Each release's real boundary is counted in tests/overlay/hooks."""
    _, boundary = bench_hot_path.build(monkeypatch.setattr)
    assert bench_hot_path.predicates(boundary)["overlay"] <= 10
