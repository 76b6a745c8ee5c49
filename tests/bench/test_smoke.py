"""Both benchmarks end to end on CPU (benchmarks/cpu_smoke.py: 2 gloo processes, CUDA graphs/events faked, a
stand-in sgl_kernel_sm120). Numbers are meaningless; the control flow, agreement, skips and JSON are not."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from benchmarks import cpu_smoke
from benchmarks.harness import schema  # noqa: E402


def _run(which, argv, timeout_s=240):
    res = cpu_smoke.launch(which, argv, world=2, timeout_s=timeout_s)
    logs = "\n".join(f"--- rank {i} rc={r.returncode}\n{r.stdout}" for i, r in enumerate(res))
    assert all(r.returncode == 0 for r in res), logs
    return logs


def assert_every_table_line_says_cpu_smoke(logs):
    # A row of numbers copied out of a CPU run must still say it is fake: rows start with a shape or a T value.
    import re

    rows = [line for line in logs.splitlines() if re.search(r"\d+\.\d\d", line)]
    table = [line for line in rows if re.match(r"^(\[CPU smoke, fake numbers\] )?\s*(\[\d+, \d+\]|flat|\d+ )", line)]
    assert table, logs
    untagged = [line for line in table if not line.startswith("[CPU smoke, fake numbers] ")]
    assert not untagged, untagged


def test_allreduce_smoke(tmp_path):
    # sglang_car_v2 is left out: on a CPU machine with nvcc its JIT build alone takes ~20 s before it fails.
    logs = _run("allreduce", ["--out", str(tmp_path), "--sizes", "1K,64K", "--rows", "1,3", "--iters", "3",
                              "--warmup", "1", "--calls", "2",
                              "--impls", "nccl,sm120,torch_symm_mem,flashinfer_pcie_ipc"])
    files = list(tmp_path.glob("allreduce_*_tp2.json"))
    assert len(files) == 1, logs
    doc = json.loads(files[0].read_text())
    schema.validate_allreduce_doc(doc)
    assert doc["complete"] is True and "schema_error" not in doc
    labels = {(r["label"], r["op"]) for r in doc["results"]}
    assert {("nccl", "allreduce"), ("sm120", "allreduce"), ("sm120[ONESHOT]", "allreduce"),
            ("nccl+add_rmsnorm", "allreduce_add_rmsnorm"), ("sm120", "allreduce_add_rmsnorm")} <= labels
    assert all(r.get("check") == "ok" and r["bitwise_across_ranks"] for r in doc["results"])
    skipped = {s["impl"] for s in doc["skipped"]}
    assert {"torch_symm_mem", "flashinfer_pcie_ipc"} <= skipped  # cannot run on CPU: recorded, not fatal
    # ISLAND needs islands: recorded per shape, with the reason
    assert any(s.get("label") == "sm120[ISLAND]" and "island" in s["reason"].lower() for s in doc["skipped"])
    # the crossover is the one its own results give (fake times: any size, or none, may come out)
    ours, nccl = doc["crossover_pair"]

    def medians(impl):
        return {r["bytes"]: r["median_us"] for r in doc["results"]
                if r["impl"] == impl and r["op"] == "allreduce" and r["rows"] is None
                and r.get("variant_mode") == "dispatch"}

    assert medians(ours) and medians(nccl), doc["results"]
    assert doc["crossover_bytes"] == schema.crossover_bytes(medians(ours), medians(nccl))
    assert files[0].with_suffix(".png").is_file()
    assert_every_table_line_says_cpu_smoke(logs)


def test_verify_smoke_and_merge(tmp_path):
    base = ["--out", str(tmp_path), "--config", "tiny_test", "--tokens", "1,4", "--iters", "2", "--warmup", "1"]
    logs = _run("verify", base + ["--compute", "none"])
    logs += _run("verify", base + ["--compute", "gemm", "--no-plot"])  # merges into the same file
    files = list(tmp_path.glob("verify_*_tp2.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    schema.validate_verify_doc(doc)
    assert doc["pattern"]["n_allreduce"] == 9 and doc["pattern"]["n_fused"] == 6
    got = {(r["backend"], r["compute"], r["tokens"]) for r in doc["results"]}
    for T in (1, 4):
        assert {("nccl", "none", T), ("sm120", "none", T), ("nccl", "gemm", T), ("sm120", "gemm", T),
                ("none", "gemm", T)} <= got
    for r in doc["results"]:
        if r["backend"] != "none":
            assert r["bitwise_across_ranks"] is True
        if r["compute"] == "none":
            assert r["comm_us"] == r["step_us"]
    checks = {(c["compute"], c["tokens"]): c for c in doc["checks"]}
    assert len(checks) == 4 and all(c["ok"] for c in checks.values())
    assert checks[("none", 1)]["rel_rms_diff"] == 0.0  # 2 ranks, comm only: bitwise equal (see test_verify.py)
    assert len(doc["runs"]) == 2
    est = doc["e2e_estimate"]
    assert [e["compute_ms"] for e in est] == [5.0, 8.0] and all(e["tokens"] == 4 for e in est)  # README's launch
    assert all("ESTIMATE" in e["label"] for e in est)
    # the accept length is the users' (60 tok/s at a 30 ms verify), not derived from the NCCL measured here
    assert all(e["accept_len"] == 1.8 and "users' figures" in e["accept_len_source"] for e in est)
    assert all(e["tok_s_nccl"] == pytest.approx(1.8 / e["step_ms_nccl"] * 1000) for e in est)
    assert_every_table_line_says_cpu_smoke(logs)


def test_allreduce_no_p2p_smoke(tmp_path):
    logs = _run("allreduce", ["--out", str(tmp_path), "--no-p2p", "--sizes", "1K", "--rows", "1,3", "--iters", "3",
                              "--warmup", "1", "--calls", "2"])
    assert [f.name for f in tmp_path.glob("allreduce_*.json")] == ["allreduce_cpu-smoke-fake_tp2_nop2p.json"], logs
    doc = json.loads((tmp_path / "allreduce_cpu-smoke-fake_tp2_nop2p.json").read_text())
    schema.validate_allreduce_doc(doc)
    assert doc["complete"] is True and "schema_error" not in doc
    assert doc["no_p2p"] is True and doc["nccl_setup"]["env_at_init"]["NCCL_P2P_DISABLE"] == "1"
    assert doc["nccl_setup"]["set_by_benchmark"]["NCCL_P2P_DISABLE"] == "1" and "_debug_file" not in doc["nccl_setup"]
    assert doc["hardware"] and doc["crossover_pair"] == ["sm120_hostmem", "nccl_no_p2p"]
    labels = {(r["label"], r["op"]) for r in doc["results"]}
    assert labels == {(lb, "allreduce") for lb in ("nccl_no_p2p", "sm120_hostmem", "sm120_hostmem[ONESHOT]",
                                                    "sm120_hostmem[TWOSHOT]")} | {
        (lb, "allreduce_add_rmsnorm") for lb in ("nccl_no_p2p+add_rmsnorm", "sm120_hostmem", "sm120_hostmem[ONESHOT]",
                                                 "sm120_hostmem[TWOSHOT]")}
    assert all(r.get("check") == "ok" for r in doc["results"]) and not doc["skipped"]
    assert doc["impl_notes"]["sm120_hostmem"]["memory"] == "host"
    assert [t["target"] for t in doc["targets"]] == [t["name"] for t in schema.NO_P2P_TARGETS]
    plain, fused = doc["targets"]
    assert plain["met"] in (True, False) and plain["speedup"] == plain["peer_us"] / plain["ours_us"]
    if not str(doc["norm_kernel"]).startswith("triton"):  # no Triton on a CPU: the fused target is not judged
        assert fused["met"] is None and "triton" in fused["why"]
    assert (tmp_path / "allreduce_cpu-smoke-fake_tp2_nop2p.png").is_file()
    assert "target allreduce_3x7168_vs_nccl_no_p2p" in logs
    assert_every_table_line_says_cpu_smoke(logs)


def test_no_p2p_refusals_before_any_number(tmp_path):
    for which, argv in (("allreduce", ["--no-p2p", "--impls", "nccl,sm120_hostmem"]),
                        ("allreduce", ["--impls", "nccl_no_p2p"]),
                        ("verify", ["--no-p2p", "--backend", "nccl,sm120_hostmem"])):
        res = cpu_smoke.launch(which, ["--out", str(tmp_path), *argv], world=2, timeout_s=120)
        assert all(r.returncode == 2 for r in res), [r.stdout for r in res]
        assert "nccl_no_p2p" in res[0].stdout
    assert not list(tmp_path.iterdir())


def test_verify_no_p2p_smoke(tmp_path):
    logs = _run("verify", ["--out", str(tmp_path), "--no-p2p", "--config", "tiny_test", "--tokens", "1,4",
                           "--iters", "2", "--warmup", "1"])
    assert [f.name for f in tmp_path.glob("verify_*.json")] == ["verify_cpu-smoke-fake_tp2_nop2p.json"], logs
    doc = json.loads((tmp_path / "verify_cpu-smoke-fake_tp2_nop2p.json").read_text())
    schema.validate_verify_doc(doc)
    assert doc["complete"] is True and "schema_error" not in doc and doc["no_p2p"] is True
    assert (doc["reference_backend"], doc["ours_backend"]) == ("nccl_no_p2p", "sm120_hostmem")
    got = {(r["backend"], r["tokens"]): r for r in doc["results"]}
    assert set(got) == {(b, T) for b in ("nccl_no_p2p", "sm120_hostmem") for T in (1, 4)}
    assert got[("sm120_hostmem", 4)]["n_fused"] == 6 and got[("nccl_no_p2p", 4)]["n_fused"] == 0
    assert all(c["reference"] == "nccl_no_p2p" and c["backend"] == "sm120_hostmem" and c["ok"] for c in doc["checks"])
    assert len(doc["checks"]) == 2 and doc["notes"]["sm120_hostmem"]["memory"] == "host"
    assert all(e["nccl_backend"] == "nccl_no_p2p" for e in doc["e2e_estimate"]) and doc["e2e_estimate"]
    assert doc["nccl_setup"]["env_at_init"]["NCCL_P2P_DISABLE"] == "1"
    assert_every_table_line_says_cpu_smoke(logs)


def test_verify_shared_gpu_is_a_correctness_run(tmp_path):
    """--shared-gpu (ranks sharing one GPU, every group on gloo): ours only, sglang_off skipped with the reason,
    the JSON says its timings mean nothing and carries no estimate, and it gets a name of its own."""
    logs = _run("verify", ["--out", str(tmp_path), "--config", "tiny_test", "--tokens", "1,3", "--iters", "2",
                           "--warmup", "1", "--compute", "none", "--shared-gpu", "--via-sglang", "--no-plot"])
    files = list(tmp_path.glob("verify_*_tp2_shared.json"))
    assert len(files) == 1, logs
    doc = json.loads(files[0].read_text())
    schema.validate_verify_doc(doc)
    assert doc["shared_gpu"] is True and doc["timings_meaningful"] is False
    assert "CORRECTNESS RUN" in doc["notes"]["shared_gpu"] and doc["e2e_estimate"] == []
    assert doc["reference_backend"] == "sm120"
    assert {r["backend"] for r in doc["results"]} == {"sm120"}
    assert any(s["impl"] == "sglang_off" and "cannot capture" in s["reason"] for s in doc["skipped"])
    assert "use_pynccl=False" in " ".join(doc["notes"]["sglang_shared_gpu_patches"])
    assert "CORRECTNESS RUN" in logs


@pytest.mark.parametrize("extra", [["--backend", "nccl"], ["--no-p2p"], ["--sglang-custom-ar", "on"]])
def test_verify_shared_gpu_refuses_what_needs_nccl(extra):
    from benchmarks import bench_verify

    with pytest.raises(SystemExit):
        bench_verify.parse_args(["--shared-gpu", *extra])
    assert bench_verify.parse_args(["--shared-gpu"]).backends == ["sm120"]


def test_verify_accept_length_is_an_input():
    from benchmarks import bench_verify

    a = bench_verify.parse_args([])
    assert (a.e2e_tokens, a.e2e_accept_len) == (4, 1.8)
    assert bench_verify.parse_args(["--e2e-accept-len", "2.5"]).e2e_accept_len == 2.5
