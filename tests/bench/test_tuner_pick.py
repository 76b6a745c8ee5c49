"""benchmarks/bench_tuner_pick.py on CPU: the sweep holds every launch the tuner could pick, one route per launch,
and the verdict is the pick against the fastest correct launch."""

from __future__ import annotations

import itertools
import json
import os

import pytest

from benchmarks import bench_tuner_pick as tp
from sgl_kernel_sm120.policy import ELEMENT_BYTES, Route, WorkspaceShape, kernel_limits, refusal
from sglang_sm120.tuning.candidates import candidates

LIMITS = kernel_limits()
RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")


def shape(world: int, sm: int = 132, islands: int = 1) -> WorkspaceShape:
    """A one-process group's workspace on an H200: each rank on a W-th of the SMs (local_group.local_group)."""
    return WorkspaceShape(world, "device", "pcie", num_islands=islands, clusters=(2, 4, 8), sm_budget=sm // world)


@pytest.mark.parametrize("world, islands", [(2, 1), (4, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize("quick", [True, False])
def test_the_sweep_holds_every_launch_the_tuner_times(world, islands, quick):
    ws = shape(world, islands=islands)
    for kind, rows in itertools.product(tp.KINDS, tp.ROWS):
        swept = {tp.launch_key(r, kind, rows, ws, LIMITS) for r in tp.sweep_routes(kind, rows, ws, LIMITS)}
        timed = candidates(kind, rows * tp.HIDDEN * ELEMENT_BYTES, tp.HIDDEN, ws, LIMITS, quick)
        assert timed, (kind, rows)
        missing = [r.id for r in timed if tp.launch_key(r, kind, rows, ws, LIMITS) not in swept]
        assert not missing, (world, kind, rows, missing)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_swept_route_runs_as_named_and_is_its_own_launch(world):
    ws = shape(world)
    for kind, rows in itertools.product(tp.KINDS, tp.ROWS):
        routes = tp.sweep_routes(kind, rows, ws, LIMITS)
        keys = [tp.launch_key(r, kind, rows, ws, LIMITS) for r in routes]
        assert len(set(keys)) == len(keys)
        for r in routes:
            assert refusal(ws, r, rows * tp.HIDDEN * ELEMENT_BYTES, fused=kind == "fused", limits=LIMITS) is None
            assert r.ctas is not None and (r.threads is not None) == (kind == "plain")  # the whole launch named
        # the kernels' other launches are in: every plain CTA size, every cluster the workspace launches
        if kind == "plain":
            assert {r.threads for r in routes} >= {64, 128, 256}
        else:
            assert {r.cluster for r in routes if r.schedule.name == "ONESHOT"} == {1, 2, 4, 8}
        assert len(routes) < 200, (world, kind, rows, len(routes))  # the stage's time: about 40 ms a launch


def test_launch_key_resolves_defaults_as_the_call_does():
    ws = shape(8)
    rows, kind = 3, "plain"
    seeded = Route("ONESHOT", "push", "device")
    named = Route("ONESHOT", "push", "device", ctas=ws.sm_budget, threads=256)  # 168 packs a CTA: one wave of 16
    assert tp.launch_key(seeded, kind, rows, ws, LIMITS) == tp.launch_key(named, kind, rows, ws, LIMITS)
    staged = Route("ONESHOT", "staged", "device", ctas=8)
    assert tp.launch_key(staged, kind, rows, ws, LIMITS) == tp.launch_key(
        Route("ONESHOT", "staged", "device", ctas=8, window=7), kind, rows, ws, LIMITS)
    assert tp.launch_key(staged, kind, rows, ws, LIMITS) != tp.launch_key(
        Route("ONESHOT", "staged", "device", ctas=8, window=1), kind, rows, ws, LIMITS)


def rec(route: str, us: float | None, correct: bool = True) -> dict:
    return {"route": route, "us": us, "result_correct": correct}


def test_the_pick_is_rated_against_the_fastest_correct_confirmed_launch():
    timed = [rec("A", 2.0), rec("B", 2.1), rec("C", 1.0, correct=False), rec("D", 3.0)]
    assert tp.confirmation_set(timed, "D", top=2) == ["D", "A", "B"]
    verdict = tp.rate(timed, "D", {"D": [2.2, 2.0, 2.1], "A": [2.0, 2.0, 2.0], "B": [2.5, 2.5, 2.5]})
    assert verdict["best"] == "A" and verdict["pick_us"] == pytest.approx(2.1)
    assert verdict["pick_over_best"] == pytest.approx(1.05) and verdict["within_target"]
    slower = tp.rate(timed, "B", {"B": [2.5], "A": [2.0]})
    assert slower["pick_over_best"] == pytest.approx(1.25) and not slower["within_target"]
    assert tp.rate(timed, "A", {"A": [2.0], "B": [2.5]})["pick_over_best"] == 1.0
    # a wrong launch is never the best, and a wrong or unconfirmed pick is never within the target
    assert tp.rate(timed, "A", {"A": [2.0], "C": [1.0]})["best"] == "A"
    assert not tp.rate(timed, "C", {"C": [1.0], "A": [2.0]})["within_target"]
    assert not tp.rate(timed, "D", {"D": [], "A": [2.0]})["within_target"]
    assert not tp.rate(timed, "nccl", {"nccl": [], "A": [2.0]})["within_target"]


def committed():
    return sorted(name for name in os.listdir(RESULTS) if name.startswith("tuner_pick_") and name.endswith(".json"))


def test_a_committed_result_holds_its_own_verdicts():
    """Each verdict of a committed run follows from its own records (the confirmation rounds are in the verdict),
    and every size's pick was timed in the sweep or beside it."""
    assert "tuner_pick_h200_concurrent.json" in committed()  # README's claim
    for name in committed():
        with open(os.path.join(RESULTS, name)) as f:
            doc = json.load(f)
        assert doc["benchmark"] == "bench_tuner_pick" and doc["summary"]
        for v in doc["summary"]:
            same = [r for r in doc["records"] if (r["world"], r["kind"], r["rows"]) == (v["world"], v["kind"],
                                                                                      v["rows"])]
            assert v["pick"] in {r["route"] for r in same} or v["pick"] == "nccl"
            confirmed = {rid: us for rid, us in v["confirmed_us"].items() if us is not None}
            if confirmed and v["best"] is not None:
                assert v["best"] == min(confirmed, key=lambda rid: (confirmed[rid], rid))
                assert v["within_target"] == (v["pick_over_best"] is not None
                                              and v["pick_over_best"] <= doc["pick_target"])


def test_a_world_end_to_end_with_stand_ins(monkeypatch):
    """_sweep_world's plumbing on CPU: the tune's picks, the sweep, the confirmation and the verdicts, with the tune
    and the timing stood in (a launch's time: its CTA cap's distance from 16, so the tuner's pick at 8 CTAs is off)."""
    ws = shape(8)

    class FakeComm:
        def __init__(self):
            self.shape, self.limits = ws, LIMITS

    class FakeGroup:
        def __init__(self, device, world):
            self.closed = 0

        def open(self):
            return [FakeComm()]

        def close(self):
            self.closed += 1

    picks = {(kind, rows): Route("ONESHOT", "push", "device", ctas=8 if rows == 16 else 16,
                                 **({"threads": 64} if kind == "plain" else {"cluster": 1}))
             for kind, rows in itertools.product(tp.KINDS, tp.ROWS)}

    def fake_time(group, route, kind, rows, calls, iters, warmup):
        assert (calls, iters, warmup) == (2, 3, 4)  # the run's settings reach every timing
        wrong = route.transport.value == "pull"  # every pull launch "wrong": never the best
        return {"us": 1.0 + abs(route.ctas - 16) / 16 + (0.5 if route.transport.value == "staged" else 0)
                + (0 if route.threads in (None, 64) else 0.01) + (0 if route.cluster in (None, 1) else 0.01),
                "result_correct": not wrong, "error": "wrong result" if wrong else None}

    monkeypatch.setattr(tp, "Group", FakeGroup)
    monkeypatch.setattr(tp, "time_route", fake_time)
    monkeypatch.setattr(tp, "tune_picks", lambda world, index: ({"entries": []}, picks, 1.5))

    class Args:
        calls, iters, warmup = 2, 3, 4

    import types

    device = types.SimpleNamespace(index=0)
    records, verdicts, tables, left_out = tp._sweep_world(8, device, Args, float("inf"), lambda line: None)
    assert left_out == 0 and tables["tune_s"] == 1.5 and tables["shape"]["sm_budget"] == 16
    assert len(verdicts) == len(tp.KINDS) * len(tp.ROWS)
    for v in verdicts:
        assert v["best"] is not None and "pull" not in v["best"]
        assert v["pick"] in v["pick_same_launch_as"] or v["pick"] in {r["route"] for r in records}
        if v["rows"] == 16:
            assert v["pick_over_best"] == pytest.approx(1.5 / 1.0) and not v["within_target"]
        else:
            assert v["pick_over_best"] == pytest.approx(1.0) and v["within_target"]
