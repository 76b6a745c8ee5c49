"""benchmarks/bench_transports.py's summary on CPU: the best transport x schedule per shape, never a wrong one."""

from __future__ import annotations

from benchmarks.bench_transports import summary


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


def test_readme_holds_the_table_rendered_from_the_committed_json():
    import json
    import pathlib

    from benchmarks.bench_transports import readme_table

    root = pathlib.Path(__file__).resolve().parents[2]
    doc = json.loads((root / "benchmarks/results/transports_h200_loopback.json").read_text())
    table = readme_table(doc["records"])
    assert table.count("\n") >= 4, table
    assert table in (root / "README.md").read_text(), f"README's transports table is not this rendering:\n{table}"


def test_a_faster_forced_configuration_is_diagnosis_never_the_summary_or_the_readme():
    from benchmarks.bench_transports import readme_table, sweep_summary

    def rec(transport, us, op, config="default", blocks=132):
        return _rec(transport, "ONESHOT", us, mode="loopback", world=2, op=op) | {
            "config": config, "blocks": blocks, "cluster": "rule"}

    records = [rec("staged", 6.0, "all_reduce", blocks=8), rec("staged", 7.0, "all_reduce_add_rmsnorm", blocks=8),
               rec("staged", 2.0, "all_reduce", "sweep"), rec("staged", 3.0, "all_reduce_add_rmsnorm", "sweep"),
               rec("push", 4.0, "all_reduce"), rec("push", 5.0, "all_reduce_add_rmsnorm")]
    best = {r["op"]: (r["best"], r["best_us"]) for r in summary(records)}
    assert best == {"all_reduce": ("ONESHOT push", 4.0), "all_reduce_add_rmsnorm": ("ONESHOT push", 5.0)}
    assert "| loopback | 2 | 4.00 / 5.00 | 6.00 / 7.00 | - |" in readme_table(records)
    diag = {r["op"]: r for r in sweep_summary(records)}
    assert diag["all_reduce"]["us_by_config"] == {"default": 6.0, "132 CTAs": 2.0}
    assert diag["all_reduce_add_rmsnorm"]["us_by_config"] == {"default": 7.0, "132 CTAs": 3.0}


def test_the_sweep_forces_each_cluster_and_staged_on_the_whole_grid_at_its_rows_only():
    from benchmarks.bench_transports import STAGED_MAX_CTAS, SWEEP_CLUSTERS, SWEEP_ROWS, _loopback_configs

    plain_rows = next(r for r in (1, 4, 64) if r not in SWEEP_ROWS)
    assert {c[-1] for c in _loopback_configs(8, plain_rows, 132)} == {"default"}
    configs = list(_loopback_configs(8, SWEEP_ROWS[0], 132))
    default = [c for c in configs if c[-1] == "default"]
    assert len(default) == 2 * 3 * 2  # ONESHOT and TWOSHOT x push/staged/pull x plain/fused
    assert all(blocks == (STAGED_MAX_CTAS if t == "staged" else 132) and cluster == 0
               for _, _, t, _, blocks, cluster, _ in default)
    sweep = [c for c in configs if c[-1] == "sweep"]
    assert {(t, op, blocks) for _, _, t, op, blocks, cluster, _ in sweep if cluster == 0} == {
        ("staged", "all_reduce", 132), ("staged", "all_reduce_add_rmsnorm", 132)}
    forced = {(t, cluster) for _, _, t, op, _, cluster, _ in sweep if cluster}
    assert forced == {(t, c) for t in ("push", "staged", "pull") for c in SWEEP_CLUSTERS}


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
        assert got["ws"] == 7 and got["inp"] is call.x and got["variant"] == 0 and got["max_blocks"] == 132
        assert got["transport"] == TRANSPORTS["pull"] == 2 and got["window"] == 3
        if op == "all_reduce":
            assert got["out"] is call.out and got["threads"] == 128
        else:  # the checked output is the residual/sum one
            assert got["residual_out"] is call.out and got["norm_out"] is call.norm and got["residual"] is call.res
            assert got["weight"] is call.weight and got["cluster"] == 4
    assert seen["refills"] == [7, 7]
