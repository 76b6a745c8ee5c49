"""bench_tune's CPU parts: the launcher's spec it measures, and how a run's table becomes its summary."""

from __future__ import annotations

import json

from benchmarks import bench_tune


def test_it_measures_the_launchers_exact_quick_spec_for_readmes_launch():
    sizes = bench_tune.capture_sizes(512)
    assert sizes[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12] and sizes[-1] == 512 and len(sizes) == 67
    args = bench_tune.launcher_args(8)
    assert "--quick" in args and "--if-missing" not in args
    assert bench_tune.option(args, "--tp") == "8" and bench_tune.option(args, "--hidden") == "7168"
    assert bench_tune.option(args, "--draft-tokens") == "4" and bench_tune.option(args, "--dtype") == "bf16"
    # the widest capture x draft tokens x hidden x 2 B passes 8 MiB: the bound's whole rows
    assert bench_tune.option(args, "--max-rows") == str((8 << 20) // (7168 * 2))
    assert bench_tune.option(args, "--cuda-graph-bs") == ",".join(map(str, sizes))
    assert bench_tune.option(bench_tune.launcher_args(2), "--max-batch") == "256"


def test_a_runs_table_becomes_its_phases_pairs_and_slowest_phase(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({
        "durations": {"torch and CUDA": 1.5, "cluster check": 0.5, "workspace": 0.25, "measure": 4.0, "total": 6.5},
        "workload": {"rows": [1, 2, 4], "pairs": {"ranked": 40, "profiled": 9, "failed": 1, "skipped": 0}},
        "measurements": [{"failed": {"a": "pruned: slower than 1.5x NCCL", "b": "verify: x"}}],
        "spec": {"calls": 4, "burst": 2, "warmup": 2, "iters": 8}}))
    summary = bench_tune.summary(str(table), 8.0)
    assert summary["phases_s"]["process start and imports"] == 1.5 and summary["slowest_phase"] == "measure"
    assert summary["pairs"] == {"ranked": 40, "profiled": 9, "failed": 1, "skipped": 0, "pruned": 1}
    assert summary["calls_of_ours"] == (40 * 2 + 9 * 12) * 4 and summary["sizes"] == 3


def test_a_run_cut_off_keeps_what_it_printed():
    import sys

    child = [sys.executable, "-c", "import time; print('[0.1 s] bfloat16 plain: size 3 of 9', flush=True); "
                                   "time.sleep(60)"]
    wall, code, tail = bench_tune.run(child, {}, 2.0)
    assert code == -1 and tail.startswith("cut at 2 s: ") and "size 3 of 9" in tail and "b'" not in tail


def test_the_one_process_tune_prints_each_new_size_once(capsys):
    from benchmarks.harness.local_tune import progress_printer
    from sglang_sm120.tuning.tuner import TuneSpec

    spec = TuneSpec.make(7168, 4, quick=False, dtypes=["bfloat16"], debug_nccl_us=1e6)
    printer = progress_printer(spec, 0.0)
    for kind, rows in (("plain", 1), ("plain", 1), ("plain", 2), ("fused", 4)):
        printer({"event": "begin", "dtype": "bfloat16", "kind": kind, "rows": rows, "candidate": "c"})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].endswith(f"plain (kind 1 of 2): 1 rows, size 1 of {len(spec.rows)}")
    assert lines[2].endswith(f"fused (kind 2 of 2): 4 rows, size {spec.rows.index(4) + 1} of {len(spec.rows)}")
