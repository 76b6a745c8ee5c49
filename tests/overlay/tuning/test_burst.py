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
from sglang_sm120.tuning import candidates, verify
from sglang_sm120.tuning.tuner import Tuner, TuneSpec, rows_ladder

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


def bursts(table) -> int:
    """Graphs captured: one per candidate's burst; a survivor's profile replays the graph its burst checked."""
    return table.workload["pairs"]["ranked"]


@pytest.mark.parametrize("kinds", [("plain",), ("fused",)])
def test_a_correct_candidate_passes_and_its_checked_graph_is_the_one_timed(kinds):
    table, group, backend = tune("good", kinds)
    assert not ours_failed(table), ours_failed(table)
    assert ours_timed(table) and any(e.route is not None for e in table.entries)
    assert backend.captures == bursts(table) > 0 and table.workload["pairs"]["profiled"] > 0


def test_a_captured_size_off_the_ladder_is_checked_by_its_profile_and_a_wrong_candidate_there_is_not_routed():
    """Off the ladder every candidate tried is profiled, in one pass whose own burst checks it first."""
    group = FakeGroup(2, "good", wrong_rows={5})
    backend = FakeBackend(group)
    spec = TuneSpec.make(HIDDEN, 8, quick=True, dtypes=["bfloat16"], kinds=["plain"], debug_nccl_us=1e6,
                         graph_rows=[5])
    measurer = LocalGroupMeasurer(world=2, device="cpu", spec=spec, backend=backend,
                                  make_group=lambda *args: group.workspaces, close_group=lambda comms: None)
    table = Tuner(measurer, spec, rank=0, world=1, gather=lambda obj: [obj], key=KEY).run()
    points = {p.rows: p for p in table.measurements[("bfloat16", "plain")]}
    assert 5 in points and 5 not in rows_ladder(8, True)
    off = points[5].failed
    assert off and all("verify: AssertionError: graph replay 1, rank 1 call" in why for cid, why in off.items()
                       if cid != tbl.NCCL), off
    assert not set(points[5].times) - {tbl.NCCL}, points[5]
    assert all(not p.failed for rows, p in points.items() if rows != 5), points
    assert tbl.lookup(table, 5 * HIDDEN * 2, "bfloat16", False) is None


def test_a_reset_forgets_the_kept_graphs_whose_workspace_it_closes():
    group = FakeGroup(2, "good")
    spec = TuneSpec.make(HIDDEN, 4, quick=True, dtypes=["bfloat16"], kinds=["plain"], debug_nccl_us=1e6)
    measurer = LocalGroupMeasurer(world=2, device="cpu", spec=spec, backend=FakeBackend(group),
                                  make_group=lambda *args: group.workspaces, close_group=lambda comms: None)
    shape = measurer.shape()
    route = next(iter(candidates.candidates("plain", 2 * HIDDEN * 2, HIDDEN, shape, measurer.limits(), True)))
    measurer.trial(route, "plain", "bfloat16", 2, profile=False)
    assert measurer._trials
    measurer.reset()
    assert not measurer._trials


@pytest.mark.parametrize("kinds", [("plain",), ("fused",)])
def test_a_candidate_returning_the_previous_calls_result_is_rejected(kinds):
    table, _, _ = tune("stale", kinds)
    failed = ours_failed(table)
    assert failed and not ours_timed(table), table.to_dict()
    # the first candidate at a size fails at its second call; the next ones get the previous candidate's last
    # result at their first
    assert all(re.search(r"graph replay 1, rank 0 call [12]:", why) for why in failed.values()), failed
    assert not any(e.route is not None for e in table.entries)


@pytest.mark.parametrize("kinds", [("plain",), ("fused",)])
def test_a_candidate_racing_buffer_reuse_with_calls_in_flight_is_rejected(kinds):
    # correct whenever the host synchronizes between calls: only calls in flight together can show it
    table, _, _ = tune("single_buffer", kinds)
    failed = ours_failed(table)
    assert failed and not ours_timed(table), table.to_dict()
    assert all("graph replay 1, rank 0 call 1:" in why for why in failed.values()), failed
    assert not any(e.route is not None for e in table.entries)


def test_ranks_whose_outputs_differ_only_in_the_sign_of_a_zero_are_rejected():
    table, _, _ = tune("zero_sign", ("plain",))
    failed = ours_failed(table)
    assert failed and not ours_timed(table)
    assert any("differ in some bit" in why for why in failed.values()), failed


@pytest.mark.parametrize("dtype, world, rows, hidden", [("bfloat16", 2, 3, HIDDEN), ("float16", 8, 5, 7168)])
def test_every_call_of_a_size_gets_inputs_of_its_own_and_their_exact_results(dtype, world, rows, hidden):
    cases = verify.case_count(4)
    fused = verify.SizeBank("fused", dtype, rows, hidden, world, range(world), "cpu", cases)
    plain = verify.SizeBank("plain", dtype, rows, hidden, world, range(world), "cpu", cases)
    seen = set()
    for case in range(cases):
        seen.add(digest(*(fused.x[r][case] for r in range(world)), fused.residual[case]))
        seen.add(("expected", digest(fused.expected[case])))
        seen.add(("plain", digest(plain.expected[case])))
        # the expected outputs are what the ops compute from these inputs, exactly (float64 reference)
        total = sum(fused.x[r][case].double() for r in range(world))
        res = total + fused.residual[case].double()
        norm = res * torch.rsqrt(res.pow(2).mean(dim=-1, keepdim=True) + fused.eps) * fused.weight.double()
        assert torch.equal(res.to(fused.torch_dtype), fused.expected[case, 1])
        assert torch.equal(norm.to(fused.torch_dtype), fused.expected[case, 0])
        plain_total = sum(plain.x[r][case].double() for r in range(world)).to(plain.torch_dtype)
        assert torch.equal(plain_total, plain.expected[case, 0])
    assert len(seen) == 3 * cases


def test_a_slot_never_sees_one_case_in_consecutive_calls_or_replays():
    calls = 4
    cases = verify.case_count(calls)
    for offset in range(3 * cases):
        this = [(offset + k) % cases for k in range(calls)]
        following = [(offset + calls + k) % cases for k in range(calls)]
        assert len(set(this)) == calls and all(a != b for a, b in zip(this, following, strict=True))
        assert this[-1] != following[0]


def test_quick_profiles_only_the_fastest_few_of_each_burst_and_keeps_the_rest_ranked():
    table, group, backend = tune("good", ("plain",), max_rows=4, world=4)
    spec_survivors = TuneSpec.make(HIDDEN, 4, quick=True).survivors
    for point in table.measurements[("bfloat16", "plain")]:
        ours = [c for c in point.times if c != tbl.NCCL]
        assert 1 <= len(ours) <= spec_survivors + 1, point  # + the previous size's fastest
        assert point.ranked and not set(point.ranked) & set(point.times), point
    assert table.workload["pairs"]["profiled"] < table.workload["pairs"]["ranked"]


def test_a_ranks_measurer_checks_a_candidate_on_its_workspace_and_times_that_graph_and_runs_nccls_step(monkeypatch):
    from sgl_kernel_sm120 import reference_add_rmsnorm
    from sglang_sm120.tuning import measure

    group = FakeGroup(1)
    backend = FakeBackend(group)
    monkeypatch.setattr(measure, "CudaBackend", lambda device, lanes: backend)
    monkeypatch.setattr(measure, "find_fused_add_rmsnorm", lambda: ("torch ops", measure._torch_add_rmsnorm))
    spec = TuneSpec.make(HIDDEN, 2, quick=True, dtypes=["bfloat16"], kinds=["fused"])
    m = measure.CudaMeasurer(rank=0, world=1, device="cpu", nccl_group="nccl", spec=spec,
                             build=lambda: group.workspaces[0])
    route = tbl.parse_route("sm120/ONESHOT/push/device/b16/c1")
    digest_burst, burst = m.trial(route, "fused", "bfloat16", 2, profile=False)
    assert digest_burst and burst == [10.0 / spec.calls] * spec.burst
    digest_profile, profile = m.trial(route, "fused", "bfloat16", 2, profile=True)
    assert digest_profile and profile == [10.0 / spec.calls] * spec.iters
    assert backend.captures == 1 and set(group.launches) == {route}  # the profile replays the burst's graph
    # NCCL's step: an all-reduce of zeros on the NCCL group, then the incumbent add + RMSNorm in place
    reduced = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda buf, group: reduced.append((buf, buf.clone(), group)))
    m._nccl("fused", "bfloat16", 2)(0)
    [(buf, before, group_used)] = reduced
    assert not before.any() and group_used == "nccl"
    bank = m._slots_for("fused", "bfloat16", 2).bank
    norm, _ = reference_add_rmsnorm(torch.zeros(2, HIDDEN), bank.residual[0], bank.weight, bank.eps)
    assert torch.equal(buf, norm)
    assert m.incumbent("fused") == "NCCL + torch ops"


def test_the_fake_workspace_offers_the_measurers_only_what_a_real_workspace_has():
    # a method the fake keeps after the real workspace lost it hides a tune whose every candidate fails on a GPU
    from sgl_kernel_sm120.ipc_allreduce import IpcAllReduce

    from .fake_group import FakeWorkspace

    offered = {name for name, value in vars(FakeWorkspace).items() if callable(value) and not name.startswith("_")}
    assert offered and {name for name in offered if not hasattr(IpcAllReduce, name)} == set()


def test_a_wait_that_timed_out_fails_the_candidate_by_its_record_not_its_fast_time():
    group = FakeGroup(2)
    group.workspaces[1].recorded_timeout = "timed out waiting for rank 0 (call 3)"
    spec = TuneSpec.make(HIDDEN, 2, quick=True, dtypes=["bfloat16"], kinds=["plain"], debug_nccl_us=1e6)
    measurer = LocalGroupMeasurer(world=2, device="cpu", spec=spec, backend=FakeBackend(group),
                                  make_group=lambda *args: group.workspaces, close_group=lambda comms: None)
    route = tbl.parse_route("sm120/ONESHOT/push/device/b16/t256")
    with pytest.raises(RuntimeError, match=r"rank 1: timed out waiting for rank 0 \(call 3\)"):
        measurer.trial(route, "plain", "bfloat16", 2, profile=False)


def test_the_table_names_each_routes_ctas_and_cluster_and_how_many_candidates_each_size_timed():
    table, group, _ = tune("good", ("plain", "fused"))
    ours = [e for e in table.entries if e.route is not None]
    assert ours and all(e.route.ctas is not None for e in ours)
    assert all(e.route.cluster is not None for e in ours if e.kind == "fused" and e.route.schedule.name == "ONESHOT")
    doc = table.to_dict()
    assert all(m["timed"] == len(m["times"]) and m["timed"] >= 2 for m in doc["measurements"])
    # what was timed is what ran: the launches were the candidates' routes, CTAs (and the fused one-shot's
    # cluster) included
    tried = {cid for points in table.measurements.values() for p in points for cid in [*p.times, *p.ranked]
             if cid != tbl.NCCL}
    assert {tbl.route_id(route) for route in group.launches} == tried
    assert {route.ctas for route in group.launches} == {16} and {1} <= {route.cluster for route in group.launches}
