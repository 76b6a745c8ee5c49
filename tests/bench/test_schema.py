"""Result schemas (sglang_sm120/reporting/schema.py) and the benchmarks' pure helpers (harness io.py, timing.py)."""

from __future__ import annotations

import copy

import pytest

from benchmarks.harness import io, ranks, schema, timing

HW = {"gpu": "NVIDIA H200", "driver": "570.1", "cuda": "13.0", "torch": "2.11.0", "nccl": "2.28.3", "world_size": 2}


def ar_entry(impl="sm120", op="allreduce", rows=None, hidden=None, nbytes=1024, us=5.0, **kw):
    return {"impl": impl, "label": impl, "op": op, "rows": rows, "hidden": hidden, "dtype": "bfloat16",
            "bytes": nbytes, "world_size": 2, "median_us": us, **kw}


def ar_doc(results, skipped=(), crossover=1024):
    return {"hardware": dict(HW), "date": "2026-11-29T00:00:00+00:00", "results": list(results),
            "skipped": list(skipped), "crossover_bytes": crossover}


def test_allreduce_doc_valid():
    doc = ar_doc([ar_entry(), ar_entry("nccl", us=9.0),
                  ar_entry(op="allreduce_add_rmsnorm", rows=3, hidden=7168, nbytes=3 * 7168 * 2)],
                 skipped=[{"impl": "flashinfer_pcie_ipc", "reason": "import failed"}])
    schema.validate_allreduce_doc(doc)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("crossover_bytes"), "crossover_bytes missing"),
        (lambda d: d["hardware"].pop("nccl"), "hardware.nccl"),
        (lambda d: d["hardware"].update(hostname="box1"), "hostname"),
        (lambda d: d["results"][0].pop("median_us"), "median_us"),
        (lambda d: d["results"][0].update(op="allgather"), "bad op"),
        (lambda d: d["results"][0].update(median_us=-1.0), "median_us"),
        (lambda d: d["results"][0].update(error="mismatch"), "errored result"),
        (lambda d: d["results"][0].update(rows=2, hidden=7168), "rows\\*hidden"),
        (lambda d: d["skipped"].append({"impl": "x"}), "skipped"),
        (lambda d: d.update(crossover_bytes=0), "crossover"),
    ],
)
def test_allreduce_doc_invalid(mutate, match):
    doc = ar_doc([ar_entry()])
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(schema.SchemaError, match=match):
        schema.validate_allreduce_doc(bad)


def test_errored_result_has_no_time():
    schema.validate_allreduce_doc(ar_doc([ar_entry(us=None, error="mismatch vs NCCL")]))


def test_crossover_bytes():
    nccl = {1024: 10.0, 2048: 10.0, 4096: 10.0, 8192: 10.0}
    assert schema.crossover_bytes({1024: 5.0, 2048: 6.0, 4096: 11.0, 8192: 5.0}, nccl) == 2048
    assert schema.crossover_bytes({1024: 12.0, 2048: 5.0}, nccl) is None
    assert schema.crossover_bytes({1024: 5.0, 2048: 5.0, 4096: 5.0, 8192: 10.0}, nccl) == 8192  # tie counts
    assert schema.crossover_bytes({1024: 5.0, 2048: None, 4096: 5.0}, nccl) == 1024  # a failed size stops it
    assert schema.crossover_bytes({}, nccl) is None


def verify_doc():
    return {
        "hardware": dict(HW), "date": "2026-11-29", "config": {"name": "kimi_k25"}, "world_size": 2,
        "pattern": {"n_allreduce": 123, "n_fused": 118, "n_plain": 5},
        "results": [
            {"backend": "nccl", "compute": "none", "tokens": 4, "step_us": 1600.0, "comm_us": 1600.0},
            {"backend": "sm120", "compute": "none", "tokens": 4, "step_us": 400.0, "comm_us": 400.0},
            {"backend": "none", "compute": "gemm", "tokens": 4, "step_us": 5000.0, "comm_us": None},
        ],
        "skipped": [],
    }


def test_verify_doc_valid_and_invalid():
    schema.validate_verify_doc(verify_doc())
    for mutate in (
        lambda d: d["pattern"].update(n_fused=119),
        lambda d: d["results"][0].pop("comm_us"),
        lambda d: d["results"][0].update(compute="both"),
        lambda d: d["results"][0].update(tokens=0),
        lambda d: d.pop("world_size"),
    ):
        bad = verify_doc()
        mutate(bad)
        with pytest.raises(schema.SchemaError):
            schema.validate_verify_doc(bad)


def test_e2e_estimate_anchored_and_given():
    e = schema.e2e_estimate(2000.0, 500.0, 5.0)
    assert e["step_ms_nccl"] == pytest.approx(7.0) and e["step_ms_ours"] == pytest.approx(5.5)
    assert e["tok_s_nccl"] == pytest.approx(60.0)  # anchored to the reported EAGLE-3-on-NCCL figure
    assert e["tok_s_ours"] == pytest.approx(60.0 * 7.0 / 5.5)
    assert e["step_speedup"] == pytest.approx(7.0 / 5.5)
    assert e["beats_nospec"] is False
    g = schema.e2e_estimate(2000.0, 500.0, 5.0, accept_len=1.0)
    assert g["accept_len"] == 1.0 and g["tok_s_ours"] == pytest.approx(1000 / 5.5)
    assert g["accept_len_source"] == "given"


def test_gpu_slug():
    assert io.gpu_slug("NVIDIA H200") == "h200"
    assert io.gpu_slug("NVIDIA RTX PRO 6000 Blackwell Workstation Edition") == (
        "rtx-pro-6000-blackwell-workstation-edition")
    assert io.gpu_slug("  ") == "unknown-gpu"


def test_parse_size_and_format():
    assert io.parse_size("1K") == 1024
    assert io.parse_size("64KB") == 65536
    assert io.parse_size("64KiB") == 65536
    assert io.parse_size("4m") == 4 << 20
    assert io.parse_size("42") == 42
    for bad in ("", "x", "1.5", "-3K"):
        with pytest.raises(ValueError):
            io.parse_size(bad)
    assert io.format_bytes(43008) == "42KB"
    assert io.format_bytes(1 << 20) == "1MB"
    assert io.format_bytes(100) == "100B"


def test_aggregate_takes_max_over_ranks_then_median():
    per_rank = [[1.0, 5.0, 3.0, 2.0, 9.0], [2.0, 1.0, 4.0, 2.0, 1.0]]
    out = timing.aggregate_iteration_times(per_rank)
    # per-iteration maxima: 2, 5, 4, 2, 9 -> median 4
    assert out["median_us"] == 4.0
    assert out["min_us"] == 2.0 and out["iters"] == 5
    with pytest.raises(ValueError):
        timing.aggregate_iteration_times([[1.0], [1.0, 2.0]])


def test_calls_per_replay_is_a_function_of_size():
    assert timing.calls_per_replay(1024) == 20
    assert timing.calls_per_replay(4 << 20) == 10
    assert timing.calls_per_replay(64 << 20) == 4
    assert timing.calls_per_replay(64 << 20, base=2) == 1


def test_write_json_atomic(tmp_path):
    p = tmp_path / "sub" / "x.json"
    io.write_json(p, {"a": 1, "v": (1, 2)})
    assert p.read_text().startswith("{")
    assert not list(tmp_path.glob("**/*.tmp"))


def test_plot_lines(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    err = io.plot_lines(png, [{"title": "t", "xlabel": "x", "ylabel": "y", "logx": 2, "logy": True,
                                   "series": {"a": ([1024, 2048], [1.0, None]), "b": ([1024], [2.0])}}])
    assert err is None and png.stat().st_size > 0


def test_bench_allreduce_defaults():
    from benchmarks import bench_allreduce as ba

    a = ba.parse_args([])
    assert a.sizes[0] == 1024 and a.sizes[-1] == 64 << 20 and len(a.sizes) == 17
    assert a.rows == [1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
    assert a.iters == 50 and "nccl" in a.impls and "sm120" in a.impls
    shapes = ba.build_shapes(a.sizes, a.rows, 7168)
    assert len(shapes) == 27
    assert shapes[0].shape == (512,) and shapes[-1].shape == (256, 7168)
    assert shapes[-1].nbytes == 256 * 7168 * 2
    q = ba.parse_args(["--quick", "--sizes", "1K,42K", "--impls", "nccl"])
    assert q.sizes == [1024, 43008] and q.iters == 20 and q.impls == ["nccl"]


def test_bench_verify_args():
    from benchmarks import bench_verify as bv

    a = bv.parse_args([])
    assert a.tokens == [1, 2, 3, 4, 8, 16, 32, 64] and a.compute == ["none"] and a.backends == ["nccl", "sm120"]
    assert a.e2e_compute_ms == [5.0, 8.0]
    b = bv.parse_args(["--compute", "none,gemm", "--backend", "nccl", "--tokens", "4,1,4"])
    assert b.compute == ["none", "gemm"] and b.backends == ["nccl"] and b.tokens == [1, 4]
    with pytest.raises(SystemExit):
        bv.parse_args(["--compute", "gpu"])


def test_require_multi_gpu_refuses_single_rank(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as e:
        ranks.require_multi_gpu("benchmarks/bench_verify.py")
    assert e.value.code == 2
    assert "No numbers were produced" in capsys.readouterr().err
