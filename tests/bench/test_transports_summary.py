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
