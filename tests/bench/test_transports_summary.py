"""benchmarks/bench_transports.py's summary on CPU: the best transport x schedule per shape, never a wrong one."""

from __future__ import annotations

import pytest

from benchmarks.bench_transports import OPS, summary


def _rec(transport, variant, us, correct=True, mode="concurrent", world=8, rows=3, op="all_reduce"):
    return {"mode": mode, "world": world, "rows": rows, "op": op, "variant": variant, "transport": transport,
            "us_per_call_median": us, "result_correct": correct}


def test_the_best_correct_route_is_named_beside_push_one_shot():
    records = [
        _rec("push", "ONESHOT", 5.0), _rec("pull", "ONESHOT", 4.0), _rec("staged", "TWOSHOT", 3.0, correct=False),
        _rec("pull", "ISLAND", 4.5), _rec("push", "ONESHOT", 2.0, mode="loopback"),
    ]
    rows = {(r["mode"], r["world"], r["rows"], r["op"]): r for r in summary(records)}
    concurrent = rows[("concurrent", 8, 3, "all_reduce")]
    assert concurrent["best"] == "ONESHOT pull" and concurrent["best_us"] == 4.0  # the wrong 3.0 is never best
    assert concurrent["push_oneshot_us"] == 5.0
    assert rows[("loopback", 8, 3, "all_reduce")]["best"] == "ONESHOT push"


def test_unchecked_results_count_and_an_all_wrong_shape_is_left_out():
    records = [_rec("push", "TWOSHOT", 7.0, correct=None, mode="loopback"), _rec("pull", "ONESHOT", 1.0, correct=False)]
    out = summary(records)
    assert [r["best"] for r in out] == ["TWOSHOT push"]


def test_the_benchmarks_readme_holds_the_table_rendered_from_the_committed_json():
    import json
    import pathlib

    from benchmarks.bench_transports import readme_table

    root = pathlib.Path(__file__).resolve().parents[2]
    doc = json.loads((root / "benchmarks/results/transports_h200_loopback.json").read_text())
    table = readme_table(doc["records"])
    assert table.count("\n") >= 4, table
    assert table in (root / "benchmarks/README.md").read_text(), f"the transports table is not this rendering:\n{table}"


def _launch_rec(transport, us, op, config="default", blocks=132, threads=256, cluster="rule", window=None,
                correct=True, rows=3):
    return _rec(transport, "ONESHOT", us, mode="loopback", world=2, op=op, correct=correct, rows=rows) | {
        "config": config, "blocks": blocks, "threads": threads if op == "all_reduce" else None, "cluster": cluster,
        "window": window}


def test_a_faster_swept_launch_is_never_the_summary_or_the_readme_but_sets_the_sweep_beside_the_default():
    from benchmarks.bench_transports import readme_table, sweep_summary

    records = [_launch_rec("staged", 6.0, "all_reduce", blocks=8, window=0),
               _launch_rec("staged", 7.0, "all_reduce_add_rmsnorm", blocks=8, window=0),
               _launch_rec("staged", 2.0, "all_reduce", "sweep", blocks=132, window=1),
               _launch_rec("staged", 3.0, "all_reduce_add_rmsnorm", "sweep", blocks=32, window=1),
               _launch_rec("push", 4.0, "all_reduce"), _launch_rec("push", 5.0, "all_reduce_add_rmsnorm")]
    best = {r["op"]: (r["best"], r["best_us"]) for r in summary(records)}
    assert best == {"all_reduce": ("ONESHOT push", 4.0), "all_reduce_add_rmsnorm": ("ONESHOT push", 5.0)}
    assert "| loopback | 2 | 4.00 / 5.00 | 6.00 / 7.00 | - |" in readme_table(records)
    sweep = {r["op"]: r for r in sweep_summary(records)}
    assert set(sweep) == set(OPS) and all(r["transport"] == "staged" for r in sweep.values())  # push: not swept
    plain = sweep["all_reduce"]
    assert plain["default_us"] == 6.0 and plain["best_us"] == 2.0 and plain["default_over_best"] == 3.0
    assert plain["within_target"] is False
    assert plain["default_launch"] == "8 CTAs x 256 threads, window default"
    assert plain["best_launch"] == "132 CTAs x 256 threads, window 1"
    assert plain["best"]["blocks"] == 132 and plain["best"]["window"] == 1 and plain["best"]["config"] == "sweep"
    assert plain["us_by_launch"] == {"default: 8 CTAs x 256 threads, window default": 6.0,
                                     "132 CTAs x 256 threads, window 1": 2.0}
    assert sweep["all_reduce_add_rmsnorm"]["best_launch"] == "32 CTAs, cluster rule, window 1"


def test_the_sweep_never_takes_a_wrong_launch_as_the_best_and_a_default_there_is_within_target():
    from benchmarks.bench_transports import TARGET_RATIO, sweep_summary

    records = [_launch_rec("pull", 5.0, "all_reduce"), _launch_rec("pull", 1.0, "all_reduce", "sweep", threads=64,
                                                                    correct=False),
               _launch_rec("pull", 4.8, "all_reduce", "sweep", threads=128)]
    (entry,) = sweep_summary(records)
    assert entry["best_us"] == 4.8 and entry["best_launch"] == "132 CTAs x 128 threads"
    assert entry["default_over_best"] == 5.0 / 4.8 <= TARGET_RATIO and entry["within_target"] is True
    assert entry["us_by_launch"]["132 CTAs x 64 threads"] is None
    wrong_default = [_launch_rec("pull", 5.0, "all_reduce", correct=False),
                     _launch_rec("pull", 4.8, "all_reduce", "sweep", threads=128)]
    (entry,) = sweep_summary(wrong_default)
    assert entry["default_us"] is None and entry["default_over_best"] is None and entry["within_target"] is False


def test_the_sweep_runs_every_launch_the_kernels_take_at_its_rows_only_and_none_twice():
    from benchmarks.bench_transports import (
        SWEEP_CLUSTERS,
        SWEEP_CTA_CAPS,
        SWEEP_ROWS,
        SWEEP_THREADS,
        _loopback_configs,
        sweep_windows,
    )

    assert sweep_windows(2) == (1,) and sweep_windows(4) == (1, 2, 3) and sweep_windows(8) == (1, 2, 7)
    plain_rows = next(r for r in (4, 64) if r not in SWEEP_ROWS)
    assert {c.config for c in _loopback_configs(8, plain_rows, 132)} == {"default"}
    for world in (2, 8):
        configs = list(_loopback_configs(world, SWEEP_ROWS[-1], 132))
        default = [c for c in configs if c.config == "default"]
        variants = 2 if world > 2 else 1  # ONESHOT, and TWOSHOT from 4 ranks on
        assert len(default) == variants * 3 * 2  # x push/staged/pull x plain/fused
        seed_threads = {"push": 128, "pull": 128, "staged": 256}  # plain_threads at 16 rows of 7168 bf16
        assert all(c.blocks == 132 and c.cluster == 0 and c.window == 0
                   and c.threads == (seed_threads[c.transport] if c.op == "all_reduce" else None) for c in default)
        sweep = [c for c in configs if c.config == "sweep"]
        assert all(c.variant_name == "ONESHOT" for c in sweep)
        assert not any(s.same_launch(d) for s in sweep for d in default)
        plain = {(c.transport, c.threads) for c in sweep if c.op == "all_reduce" and c.window == 0}
        assert plain == {(t, n) for t in ("push", "staged", "pull") for n in SWEEP_THREADS if n != seed_threads[t]}
        clusters = {(c.transport, c.cluster) for c in sweep if c.cluster}
        assert clusters == {(t, c) for t in ("push", "staged", "pull") for c in SWEEP_CLUSTERS}
        staged = {(c.op, c.blocks, c.window) for c in sweep if c.window}
        assert staged == {(op, cap, w) for op in OPS for cap in (*SWEEP_CTA_CAPS, 132) for w in sweep_windows(world)}
    assert {c.blocks for c in _loopback_configs(2, 3, 20) if c.window} == {8, 16, 20}  # caps above the budget


def test_the_profile_cases_are_the_issue_17_misses_and_list_one_per_line(capsys):
    from benchmarks import profile_transports

    assert profile_transports.main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert names == list(profile_transports.CASES)
    cases = set(profile_transports.CASES.values())
    assert (8, "all_reduce_add_rmsnorm", "push") in cases  # the W = 8 fused target
    assert {(2, op, t) for op in ("all_reduce", "all_reduce_add_rmsnorm") for t in ("push", "staged", "pull")} <= cases


def test_a_loopback_call_passes_each_tensor_and_setting_where_the_ops_schema_wants_it():
    """LoopbackCall against the built library's own op schemas (CPU tensors: nothing launches; a recorder stands
    in for torch.ops and binds the positional arguments to the schema's names)."""
    import torch

    from benchmarks.bench_transports import TRANSPORTS, LoopbackCall
    from sgl_kernel_sm120 import _ext

    real = _ext.ops()
    seen = {}

    class Recorder:
        def ws_loopback_refill(self, ws):
            seen.setdefault("refills", []).append(ws)

        def __getattr__(self, name):
            names = [a.name for a in getattr(real, name).default._schema.arguments]
            return lambda *args: seen.update({name: dict(zip(names, args, strict=True))})

    for op in ("all_reduce", "all_reduce_add_rmsnorm"):
        call = LoopbackCall(Recorder(), 7, 8, 3, torch.device("cpu"), 0, "pull", op, blocks=132, cluster=4,
                            threads=128, window=3)
        call(0)
        got = seen[op]
        assert got["ws"] == 7 and got["inp"] is call.x and got["schedule"] == 0 and got["ctas"] == 132
        assert got["transport"] == TRANSPORTS["pull"] == 2 and got["window"] == 3
        if op == "all_reduce":
            assert got["out"] is call.out and got["threads"] == 128
        else:  # the checked output is the residual/sum one
            assert got["residual_out"] is call.out and got["norm_out"] is call.norm and got["residual"] is call.res
            assert got["weight"] is call.weight and got["cluster"] == 4
    assert seen["refills"] == [7, 7]


def test_the_loopback_stage_records_every_launch_with_its_fields_and_the_sweep_rates_the_default(monkeypatch):
    """bench_transports._loopback end to end on CPU: the ops, graphs and timings are stand-ins (a call fills its
    output with the expected sum, and its time is a function of its launch), the launch choice and the records are
    the benchmark's own."""
    import argparse
    import types

    import torch

    from benchmarks import bench_transports as bt

    calls = []

    def fill(out, world, op):
        out.fill_(world + (op != "all_reduce"))

    ops = types.SimpleNamespace(
        ws_create_loopback=lambda device, world, numel: world,
        ws_launch_limits=lambda ws: [132, 66, 62, 15],
        ws_loopback_refill=lambda ws: None,
        ws_destroy=lambda ws: None,
        fused_cluster_for=lambda rows, hidden, blocks, capacity: calls.append((rows, blocks, tuple(capacity))) or 4,
        all_reduce=lambda ws, x, out, variant, threads, blocks, pdl, code, window: fill(out, ws, "all_reduce"),
        all_reduce_add_rmsnorm=lambda ws, x, res, w, eps, norm, out, variant, blocks, pdl, cluster, code, window:
            fill(out, ws, "fused"),
    )
    def capture_graph(step, n):
        step(0)
        return types.SimpleNamespace(step=step), None

    def replay_times(graph, iters, warmup=0, sync_each=True):
        assert warmup == 4  # the run's --warmup: every timed graph is replayed untimed first
        c = graph.step
        if not isinstance(c, bt.LoopbackCall):
            return [20.0] * iters  # the fills alone: 1 us per call
        us = 10.0 - (c.blocks == 132) - (c.threads == 128) - 1.5 * (c.window == 2) - (c.cluster == 8)
        return [us * 20 + 20.0] * iters  # plus 1 us of fill per call

    monkeypatch.setattr(bt, "WORLDS", (4,))
    monkeypatch.setattr(bt, "ROWS", (3, 4))
    monkeypatch.setattr(bt.timing, "capture_graph", capture_graph)
    monkeypatch.setattr(bt.timing, "replay_times", replay_times)
    monkeypatch.setattr("sgl_kernel_sm120._ext.ops", lambda: ops)
    stages = {}
    args = argparse.Namespace(calls=20, iters=3, warmup=4)
    records, fill_us, limits, left_out = bt._loopback(args, torch.device("cpu"), stages)
    assert left_out == 0 and fill_us == {"4x3": 1.0, "4x4": 1.0}
    assert limits == {"4": {"sm_budget": 132, "cluster_capacity": {"2": 66, "4": 62, "8": 15}}}
    assert set(stages) == {"loopback W=4 rows=3", "loopback W=4 rows=4"}
    assert len(records) == len(list(bt._loopback_configs(4, 3, 132))) + len(list(bt._loopback_configs(4, 4, 132)))
    assert all(r["result_correct"] is not False for r in records)
    for r in records:
        assert r["us_per_call_median"] == pytest.approx(10.0 - (r["blocks"] == 132) - (r["threads"] == 128)
                                                        - 1.5 * (r["window"] == 2) - (r["cluster"] == 8))
        fused_one_shot = r["op"] != "all_reduce" and r["variant"] == "ONESHOT"
        assert (r["cluster_used"] is not None) == fused_one_shot
        assert r["cluster_used"] == (r["cluster"] if r["cluster"] != "rule" else 4) or not fused_one_shot
        assert (r["window"] is not None) == (r["transport"] == "staged")
    # The rule was asked with the call's CTA cap and the capacities for 2, 4, 8.
    assert (3, 8, (66, 62, 15)) in calls and (3, 132, (66, 62, 15)) in calls
    sweep = {(e["op"], e["transport"]): e for e in bt.sweep_summary(records)}
    staged = sweep[("all_reduce", "staged")]
    assert staged["best_us"] == pytest.approx(7.5) and staged["best_launch"] == "132 CTAs x 256 threads, window 2"
    assert staged["default_over_best"] == pytest.approx(9.0 / 7.5) and not staged["within_target"]
    push = sweep[("all_reduce", "push")]
    assert push["best_launch"] == "132 CTAs x 128 threads" and push["default_over_best"] == pytest.approx(9 / 8)
