"""The tuner's verification can fail: a candidate that returns the previous call's result, one whose buffer reuse
races when calls are in flight, and one whose ranks' bits differ are rejected and never routed; a correct one
passes, and its checked graph is the timed one. The one-process measurer (benchmarks/harness/local_tune.py) runs on
fake workspaces over CPU tensors (tests/overlay/tuning/fake_group.py)."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from benchmarks.harness.local_tune import LocalGroupMeasurer
from sglang_sm120.routing import table as tbl
from sglang_sm120.tuning import verify
from sglang_sm120.tuning.tuner import Tuner, TuneSpec

from .fake_group import FakeBackend, FakeGroup

HIDDEN = 64
KEY = {"world_size": 2, "gpus": [{"uuid": "GPU-0"}, {"uuid": "GPU-0"}], "memory": "device"}


def tune(mode: str, kinds=("plain",), max_rows: int = 4, world: int = 2):
    group = FakeGroup(world, mode)
    backend = FakeBackend(group)
    spec = TuneSpec.make(HIDDEN, max_rows, quick=True, dtypes=["bfloat16"], kinds=list(kinds), debug_nccl_us=1e6)
    measurer = LocalGroupMeasurer(world=world, device="cpu", spec=spec, backend=backend,
                                  make_group=lambda *args: group.workspaces, close_group=lambda comms: None)
    table = Tuner(measurer, spec, rank=0, world=1, gather=lambda obj: [obj], key=KEY).run()
    return table, group, backend


def digest(*tensors) -> str:
    """sha256 of the tensors' bytes: every bit, a zero's sign included."""
    return hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)).hexdigest()


def ours_failed(table) -> dict[str, str]:
    return {cid: why for points in table.measurements.values() for p in points for cid, why in p.failed.items()
            if cid != tbl.NCCL}


def ours_timed(table) -> set[str]:
    return {cid for points in table.measurements.values() for p in points for cid in p.times if cid != tbl.NCCL}


@pytest.mark.parametrize("kinds", [("plain",), ("fused",)])
def test_a_correct_candidate_passes_and_its_checked_graph_is_the_one_timed(kinds):
    table, group, backend = tune("good", kinds)
    assert not ours_failed(table), ours_failed(table)
    assert ours_timed(table) and any(e.route is not None for e in table.entries)
    points = table.measurements[("bfloat16", kinds[0])]
    assert backend.captures == sum(len([c for c in p.times if c != tbl.NCCL]) for p in points)


@pytest.mark.parametrize("kinds", [("plain",), ("fused",)])
def test_a_candidate_returning_the_previous_calls_result_is_rejected(kinds):
    table, _, _ = tune("stale", kinds)
    failed = ours_failed(table)
    assert failed and not ours_timed(table), table.to_dict()
    # the first candidate at a size fails at its second call; the next ones get the previous candidate's last
    # result at their first
    assert all(re.search(r"eager call [12] rank 0", why) for why in failed.values()), failed
    assert not any(e.route is not None for e in table.entries)


@pytest.mark.parametrize("kinds", [("plain",), ("fused",)])
def test_a_candidate_racing_buffer_reuse_with_calls_in_flight_is_rejected(kinds):
    # correct whenever the host synchronizes between calls: only the graph burst can see it
    table, _, _ = tune("single_buffer", kinds)
    failed = ours_failed(table)
    assert failed and not ours_timed(table), table.to_dict()
    assert all("graph replay 1 call 1 rank 0" in why for why in failed.values()), failed
    assert not any(e.route is not None for e in table.entries)


def test_ranks_whose_outputs_differ_only_in_the_sign_of_a_zero_are_rejected():
    table, _, _ = tune("zero_sign", ("plain",))
    failed = ours_failed(table)
    assert failed and not ours_timed(table)
    assert any("differ in some bit" in why for why in failed.values()), failed


@pytest.mark.parametrize("dtype, world, rows, hidden", [("bfloat16", 2, 3, HIDDEN), ("float16", 8, 5, 7168)])
def test_every_call_of_a_candidate_and_every_candidate_get_inputs_of_their_own(dtype, world, rows, hidden):
    bank = verify.CallBank("fused", dtype, rows, hidden, world, range(world), "cpu")
    plain = verify.CallBank("plain", dtype, rows, hidden, world, range(world), "cpu")
    seen = set()
    for cid in ("sm120/ONESHOT/push/device/b16/c1", "sm120/ONESHOT/push/device/b8/c1"):
        first = verify.salt(cid)
        for j in range(6):
            given, expected = bank.inputs(first + j), bank.expected(first + j)
            seen.add(digest(given["x"][0], given["residual"]))
            seen.add(("expected", digest(*expected)))
            seen.add(("plain", digest(*plain.expected(first + j))))
            # the expected outputs are what the ops compute from these inputs, exactly (float64 reference)
            total = sum(given["x"][r].double() for r in range(world))
            res = total + given["residual"].double()
            norm = res * torch.rsqrt(res.pow(2).mean(dim=-1, keepdim=True) + bank.eps) * bank.weight32.double()
            assert verify.same_values(res.to(bank.torch_dtype), expected[1])
            assert verify.same_values(norm.to(bank.torch_dtype), expected[0])
            plain_given = plain.inputs(first + j)["x"]
            assert verify.same_values(sum(plain_given[r].double() for r in range(world)).to(bank.torch_dtype),
                                      plain.expected(first + j)[0])
    assert len(seen) == 3 * 2 * 6


def test_consecutive_calls_roll_by_different_amounts_whatever_the_element_count():
    for numel in (8, 64, 9973 * 8, 7168 * 128):
        assert all(verify.shift(v, numel) != verify.shift(v + 1, numel) for v in range(50))


def test_time_without_its_verify_is_refused():
    group = FakeGroup(2)
    spec = TuneSpec.make(HIDDEN, 2, quick=True, dtypes=["bfloat16"], kinds=["plain"], debug_nccl_us=1e6)
    measurer = LocalGroupMeasurer(world=2, device="cpu", spec=spec, backend=FakeBackend(group),
                                  make_group=lambda *args: group.workspaces, close_group=lambda comms: None)
    route = tbl.parse_route("sm120/ONESHOT/push/device/b16")
    with pytest.raises(RuntimeError, match="without its verify"):
        measurer.time(route, "plain", "bfloat16", 2)
    measurer.verify(route, "plain", "bfloat16", 2)
    assert measurer.time(route, "plain", "bfloat16", 2)


def test_a_ranks_measurer_checks_a_candidate_on_its_workspace_and_times_that_graph_and_runs_nccls_step(monkeypatch):
    from sgl_kernel_sm120 import reference_add_rmsnorm
    from sglang_sm120.tuning import measure

    group = FakeGroup(1)
    backend = FakeBackend(group)
    monkeypatch.setattr(measure, "CudaBackend", lambda device, lanes: backend)
    monkeypatch.setattr(measure.CudaMeasurer, "_workspace", lambda self: group.workspaces[0])
    monkeypatch.setattr(measure, "find_fused_add_rmsnorm", lambda: ("torch ops", measure._torch_add_rmsnorm))
    spec = TuneSpec.make(HIDDEN, 2, quick=True, dtypes=["bfloat16"], kinds=["fused"])
    m = measure.CudaMeasurer(rank=0, world=1, device="cpu", cpu_group=None, nccl_group="nccl", spec=spec)
    route = tbl.parse_route("sm120/ONESHOT/push/device/b16/c1")
    with pytest.raises(RuntimeError, match="without its verify"):
        m.time(route, "fused", "bfloat16", 2)
    assert m.verify(route, "fused", "bfloat16", 2)
    assert m.time(route, "fused", "bfloat16", 2) == [10.0 / spec.calls] * spec.iters
    assert backend.captures == 1 and set(group.launches) == {route}
    # NCCL's step: an all-reduce of zeros on the NCCL group, then the incumbent add + RMSNorm in place
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda buf, group: reduced.append((buf, buf.clone(), group)))
    m._nccl("fused", "bfloat16", 2)(0)
    [(buf, before, group)] = reduced
    assert not before.any() and group == "nccl"
    bank = verify.CallBank("fused", "bfloat16", 2, HIDDEN, 1, [0], "cpu")
    norm, _ = reference_add_rmsnorm(torch.zeros(2, HIDDEN), bank.inputs(0)["residual"], bank.weight, bank.eps)
    assert torch.equal(buf, norm)
    assert m.incumbent("fused") == "NCCL + torch ops"


def test_the_table_names_each_routes_ctas_and_cluster_and_how_many_candidates_each_size_timed():
    table, group, _ = tune("good", ("plain", "fused"))
    ours = [e for e in table.entries if e.route is not None]
    assert ours and all(e.route.ctas is not None for e in ours)
    assert all(e.route.cluster is not None for e in ours if e.kind == "fused" and e.route.schedule.name == "ONESHOT")
    doc = table.to_dict()
    assert all(m["timed"] == len(m["times"]) and m["timed"] >= 2 for m in doc["measurements"])
    # what was timed is what ran: the launches were the candidates' routes, CTAs (and the fused one-shot's
    # cluster) included
    timed = {cid for points in table.measurements.values() for p in points for cid in p.times if cid != tbl.NCCL}
    assert {tbl.route_id(route) for route in group.launches} == timed
    assert {route.ctas for route in group.launches} == {16} and {1} <= {route.cluster for route in group.launches}
