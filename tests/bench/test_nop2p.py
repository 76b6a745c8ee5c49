"""The --no-p2p mode of the benchmarks (ours through host memory against NCCL with NCCL_P2P_DISABLE=1): which
names each mode accepts, the NCCL environment it sets up before NCCL starts, the output names, the NCCL log
parsing, and the targets computed from (synthetic) results. The end-to-end runs are in test_smoke.py."""

from __future__ import annotations

import argparse
import copy
import os
import sys
import types

import pytest

from benchmarks.harness import io, nccl_mode, schema

HW = {"gpu": "NVIDIA H200", "driver": "570.1", "cuda": "13.0", "torch": "2.11.0", "nccl": "2.28.9", "world_size": 2}
TRITON = "triton (benchmarks/harness/triton_add_rmsnorm.py)"


# ---------------------------------------------------------------------------------------------------------
# names per mode


def test_nccl_label_error():
    assert nccl_mode.nccl_label_error(["nccl", "sm120"], no_p2p=False) is None
    assert nccl_mode.nccl_label_error(["nccl_no_p2p", "sm120_hostmem"], no_p2p=True) is None
    assert nccl_mode.nccl_label_error(["sm120_hostmem"], no_p2p=False) is None  # ours via host memory: any mode
    why = nccl_mode.nccl_label_error(["nccl"], no_p2p=True)
    assert "nccl_no_p2p" in why and "NCCL_P2P_DISABLE=1" in why
    why = nccl_mode.nccl_label_error(["sm120", "nccl_no_p2p"], no_p2p=False)
    assert "--no-p2p" in why and "once per process" in why


def _exit_code(fn, capsys):
    with pytest.raises(SystemExit) as e:
        fn()
    return e.value.code, capsys.readouterr().err


def test_bench_allreduce_no_p2p_defaults():
    from benchmarks import bench_allreduce as ba

    a = ba.parse_args(["--no-p2p"])
    assert a.no_p2p and a.impls == ["nccl_no_p2p", "sm120_hostmem"]
    assert a.rows == [1, 3, 4, 16, 64] and a.sizes == ba.QUICK_SIZES and a.iters == 50
    assert a.norm_kernel == "triton"
    assert ba.parse_args(["--no-p2p", "--norm-kernel", "torch"]).norm_kernel == "torch"
    assert ba.parse_args(["--no-p2p", "--sizes", "none"]).sizes == []
    plain = ba.parse_args([])
    assert not plain.no_p2p and "nccl" in plain.impls and "nccl_no_p2p" not in plain.impls
    assert "sm120_hostmem" not in plain.impls and plain.norm_kernel is None
    assert ba.parse_args(["--impls", "nccl,sm120_hostmem"]).impls == ["nccl", "sm120_hostmem"]
    assert ba.reference_names(True) == ("sm120_hostmem", "nccl_no_p2p")
    assert ba.reference_names(False) == ("sm120", "nccl")
    assert ba.mode_targets(True) == schema.NO_P2P_TARGETS and ba.mode_targets(False) == ()


@pytest.mark.parametrize("argv, says", [
    (["--no-p2p", "--impls", "nccl,sm120_hostmem"], "nccl_no_p2p"),
    (["--impls", "nccl_no_p2p,sm120_hostmem"], "needs --no-p2p"),
    (["--impls", "nccl,bogus"], "unknown implementation"),
    (["--impls", ""], "--impls is empty"),
])
def test_bench_allreduce_refusals(argv, says, capsys):
    from benchmarks import bench_allreduce as ba

    code, err = _exit_code(lambda: ba.parse_args(argv), capsys)
    assert code == 2 and says in err


def test_bench_verify_backends_per_mode(capsys):
    from benchmarks import bench_verify as bv

    a = bv.parse_args(["--no-p2p"])
    assert a.backends == ["nccl_no_p2p", "sm120_hostmem"] and a.tokens == [1, 2, 3, 4, 8, 16, 32, 64]
    assert a.compute == ["none"] and a.norm_kernel == "triton"
    assert bv.reference_backends(a.backends, True) == ("nccl_no_p2p", "sm120_hostmem")
    b = bv.parse_args(["--backend", "nccl,sm120_hostmem"])
    assert b.backends == ["nccl", "sm120_hostmem"] and bv.reference_backends(b.backends, False) == (
        "nccl", "sm120_hostmem")
    c = bv.parse_args(["--backend", "nccl,sm120,sm120_hostmem"])
    assert bv.reference_backends(c.backends, False) == ("nccl", "sm120")
    assert bv.parse_args(["--backend", "sm120"]).backends == ["sm120"]
    for argv, says in ((["--no-p2p", "--backend", "nccl,sm120_hostmem"], "nccl_no_p2p"),
                       (["--backend", "nccl_no_p2p"], "needs --no-p2p"),
                       (["--no-p2p", "--via-sglang"], "--via-sglang"),
                       (["--backend", "gloo"], "--backend takes")):
        code, err = _exit_code(lambda argv=argv: bv.parse_args(argv), capsys)
        assert code == 2 and says in err, (argv, err)


def test_make_impl_refuses_the_other_modes_nccl():
    pytest.importorskip("torch")
    from benchmarks import peers

    with pytest.raises(ValueError, match="nccl_no_p2p"):
        peers.make_impl("nccl", argparse.Namespace(no_p2p=True))
    with pytest.raises(ValueError, match="--no-p2p"):
        peers.make_impl("nccl_no_p2p", argparse.Namespace(no_p2p=False))
    assert isinstance(peers.make_impl("nccl_no_p2p", argparse.Namespace(no_p2p=True)), peers.NcclNoP2p)
    assert isinstance(peers.make_impl("nccl", argparse.Namespace()), peers.Nccl)
    impl = peers.make_impl("sm120_hostmem", argparse.Namespace(no_p2p=False, ours_timeout_s=7.0))
    assert isinstance(impl, peers.Sm120Hostmem) and impl.timeout_s == 7.0
    assert set(peers.NO_P2P_IMPLS) <= set(peers.KNOWN_IMPLS) and not set(peers.NO_P2P_IMPLS) & set(peers.ALL_IMPLS)


def test_sm120_hostmem_needs_the_host_transport(monkeypatch):
    pytest.importorskip("torch")
    from benchmarks import peers

    old = types.ModuleType("sgl_kernel_sm120")

    def old_ctor(group, device, max_numel, dtype=None, *, islands=None, link="auto", timeout_s=None):
        raise AssertionError("not called")

    old.IpcAllReduce = old_ctor
    monkeypatch.setitem(sys.modules, "sgl_kernel_sm120", old)
    impl = peers.Sm120Hostmem()
    with pytest.raises(RuntimeError, match="no memory= argument"):
        impl._import()

    impl.ar = types.SimpleNamespace(memory="device", link=types.SimpleNamespace(value="pcie"))
    assert "not the host transport" in impl._check_built()
    impl.ar = types.SimpleNamespace(memory="host", link=types.SimpleNamespace(value="host"))
    assert impl._check_built() is None
    impl.mod = types.SimpleNamespace(Schedule=[types.SimpleNamespace(name=n) for n in ("ONESHOT", "TWOSHOT", "ISLAND")])
    assert [label for label, _ in impl.variants()] == [None, "ONESHOT", "TWOSHOT"]
    kw = impl._ctor_kwargs(None)
    assert kw["memory"] == "host" and kw["islands"] is None and "link" not in kw


# ---------------------------------------------------------------------------------------------------------
# the NCCL environment, set up before NCCL starts


def test_prepare_no_p2p_sets_the_env_before_nccl():
    env = {"NCCL_P2P_DISABLE": "0", "PATH": "/bin"}
    mode = nccl_mode.prepare_nccl_mode(True, True, env, nccl_started=False)
    try:
        assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_DEBUG"] == "INFO"
        assert env["NCCL_DEBUG_FILE"].endswith("nccl.%p.log") and "%h" not in env["NCCL_DEBUG_FILE"]
        assert mode["mode"] == "no_p2p" and mode["no_p2p"] is True
        assert mode["env_before"]["NCCL_P2P_DISABLE"] == "0" and mode["env_before"]["NCCL_DEBUG"] is None
        assert mode["env_at_init"]["NCCL_P2P_DISABLE"] == "1" and "PATH" not in mode["env_at_init"]
        public = nccl_mode.public_nccl_mode(mode)
        assert "_debug_file" not in public and public["set_by_benchmark"]["NCCL_P2P_DISABLE"] == "1"
    finally:
        nccl_mode.cleanup_nccl_log(mode)
    assert not os.path.exists(os.path.dirname(mode["_debug_file"]))


def test_prepare_no_p2p_leaves_a_callers_debug_settings():
    env = {"NCCL_DEBUG": "WARN", "NCCL_NVLS_ENABLE": "0"}
    mode = nccl_mode.prepare_nccl_mode(True, True, env, nccl_started=False)
    assert env == {"NCCL_DEBUG": "WARN", "NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1"}
    assert mode["_debug_file"] is None and "not collected" in mode["transport_log"]


@pytest.mark.parametrize("env, started, says", [
    ({}, True, "already initialised"),
    ({"NCCL_SHM_DISABLE": "1"}, False, "NCCL_SHM_DISABLE"),
    ({"NCCL_NVLS_ENABLE": "1"}, False, "NCCL_NVLS_ENABLE"),
])
def test_prepare_no_p2p_refusals(env, started, says):
    before = dict(env)
    with pytest.raises(ValueError, match=says):
        nccl_mode.prepare_nccl_mode(True, True, env, nccl_started=started)
    assert env == before  # nothing set when it refuses


def test_default_mode_refuses_a_p2p_free_nccl_named_nccl():
    for env in ({"NCCL_P2P_DISABLE": "1"}, {"NCCL_P2P_DISABLE": "0x1"}, {"NCCL_P2P_LEVEL": "LOC"}):
        with pytest.raises(ValueError, match="--no-p2p"):
            nccl_mode.prepare_nccl_mode(False, True, dict(env), nccl_started=False)
        mode = nccl_mode.prepare_nccl_mode(False, False, dict(env), nccl_started=False)  # no NCCL result: allowed
        assert mode["p2p_disabled_by"]
    mode = nccl_mode.prepare_nccl_mode(False, True, {"NCCL_P2P_DISABLE": "0", "NCCL_P2P_LEVEL": "SYS"},
                                    nccl_started=True)
    assert mode == {"mode": "default", "no_p2p": False, "set_by_benchmark": {}, "p2p_disabled_by": [],
                    "env_at_init": {"NCCL_P2P_DISABLE": "0", "NCCL_P2P_LEVEL": "SYS"}}


def test_default_mode_logs_which_transports_nccl_chose_unless_the_caller_set_its_log():
    env = {"NCCL_P2P_LEVEL": "SYS"}
    mode = nccl_mode.prepare_nccl_mode(False, True, env, nccl_started=False)
    try:
        assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_FILE"] == mode["_debug_file"]
        assert mode["env_at_init"]["NCCL_P2P_LEVEL"] == "SYS" and mode["set_by_benchmark"]["NCCL_DEBUG"] == "INFO"
        assert "NCCL_P2P_LEVEL" in nccl_mode.nccl_setup_line(nccl_mode.public_nccl_mode(mode))
    finally:
        nccl_mode.cleanup_nccl_log(mode)
    env = {"NCCL_DEBUG": "WARN"}
    mode = nccl_mode.prepare_nccl_mode(False, True, env, nccl_started=False)
    assert env == {"NCCL_DEBUG": "WARN"} and mode["_debug_file"] is None and "not collected" in mode["transport_log"]


def test_enter_nccl_mode_exits_2_before_any_number(monkeypatch, capsys):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    code, err = _exit_code(lambda: nccl_mode.enter_nccl_mode("benchmarks/bench_allreduce.py", False, True), capsys)
    assert code == 2 and "No numbers were produced" in err and "NCCL_P2P_DISABLE=1" in err


# ---------------------------------------------------------------------------------------------------------
# NCCL's log, output names


LOG = """\
box:1:2 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
box:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
box:1:2 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via SHM/direct/direct
box:1:2 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 0
"""


def test_parse_and_merge_nccl_logs(tmp_path):
    assert nccl_mode.parse_nccl_log(LOG) == {"transports": {"SHM": 2}, "nccl_version": "2.28.9+cuda13.0"}
    p2p = nccl_mode.parse_nccl_log("x [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM/read\n")
    assert p2p["transports"] == {"P2P": 1} and p2p["nccl_version"] is None
    shm = {"found": True, **nccl_mode.parse_nccl_log(LOG)}
    m = nccl_mode.merge_nccl_logs([shm, shm])
    assert m["transports_seen"] == {"SHM": 4} and m["p2p_seen"] is False and m["ranks_with_log"] == 2
    assert m["verdict"] == "no P2P channel logged" and m["nccl_version_logged"] == "2.28.9+cuda13.0"
    m = nccl_mode.merge_nccl_logs([shm, {"found": True, **p2p}])
    assert m["p2p_seen"] is True and m["verdict"] == "P2P channels logged"
    assert nccl_mode.merge_nccl_logs([None, None])["verdict"] == "not collected"
    missing = {"found": False, "transports": {}, "nccl_version": None}
    assert nccl_mode.merge_nccl_logs([missing, missing])["verdict"] == "no NCCL log file was written"
    # this process's file, by pid
    (tmp_path / f"nccl.{os.getpid()}.log").write_text(LOG)
    got = nccl_mode.read_nccl_log(str(tmp_path / "nccl.%p.log"))
    assert got["found"] and got["transports"] == {"SHM": 2}
    assert nccl_mode.read_nccl_log(None) is None
    assert nccl_mode.read_nccl_log(str(tmp_path / "none.%p.log"))["found"] is False


def test_output_names():
    tag = nccl_mode.output_tag(True)
    assert io.result_path("r", "allreduce", "NVIDIA H200", 2, tag=tag).name == "allreduce_h200_tp2_nop2p.json"
    assert io.result_path("r", "allreduce", "NVIDIA H200", 2, ".png", tag=tag).name == (
        "allreduce_h200_tp2_nop2p.png")
    assert io.result_path("r", "verify", "NVIDIA H200", 8, tag=tag).name == "verify_h200_tp8_nop2p.json"
    assert io.result_path("r", "allreduce", "NVIDIA H200", 2, tag=nccl_mode.output_tag(False)).name == (
        "allreduce_h200_tp2.json")
    assert io.result_path("r", "verify", "NVIDIA H200", 2).with_suffix(".png").name == "verify_h200_tp2.png"


# ---------------------------------------------------------------------------------------------------------
# targets


def entry(label, op, us, rows=3, error=None):
    impl = label.split("[")[0].split("+")[0]
    return {"impl": impl, "label": label, "op": op, "rows": rows, "hidden": 7168, "dtype": "bfloat16",
            "bytes": rows * 7168 * 2, "world_size": 2, "median_us": None if error else us,
            **({"error": error} if error else {})}


AR, FU = "allreduce", "allreduce_add_rmsnorm"


def results(ours_ar=10.0, peer_ar=35.0, ours_fu=12.0, peer_fu=30.0):
    return [entry("nccl_no_p2p", AR, peer_ar), entry("sm120_hostmem", AR, ours_ar),
            entry("sm120_hostmem[ONESHOT]", AR, 1.0),  # a forced variant is not what the target measures
            entry("nccl_no_p2p+add_rmsnorm", FU, peer_fu), entry("sm120_hostmem", FU, ours_fu),
            entry("sm120_hostmem", AR, 1.0, rows=4)]  # another shape


def targets_of(rs, **kw):
    kw.setdefault("norm_kernel", TRITON)
    return {t["target"]: t for t in schema.evaluate_targets(rs, schema.NO_P2P_TARGETS, **kw)}


PLAIN, FUSED = (t["name"] for t in schema.NO_P2P_TARGETS)


def test_targets_computed_from_the_medians():
    ts = targets_of(results())
    p, f = ts[PLAIN], ts[FUSED]
    assert (p["ours_us"], p["peer_us"], p["speedup"], p["met"], p["why"]) == (10.0, 35.0, 3.5, True, None)
    assert (f["ours_us"], f["peer_us"], f["speedup"], f["met"]) == (12.0, 30.0, 2.5, False)
    assert f["peer"] == "nccl_no_p2p+add_rmsnorm" and f["peer_norm_kernel"] == TRITON
    assert p["rows"] == 3 and p["hidden"] == 7168 and p["required_speedup"] == 3.0
    assert targets_of(results(ours_ar=10.0, peer_ar=30.0))[PLAIN]["met"] is True  # exactly 3x counts


def test_targets_not_judged_say_why():
    ts = targets_of([r for r in results() if r["label"] != "nccl_no_p2p"])
    assert ts[PLAIN]["met"] is None and "nccl_no_p2p not measured at [3, 7168]" in ts[PLAIN]["why"]
    assert ts[FUSED]["met"] is False and ts[FUSED]["speedup"] == 2.5  # the other one is still judged
    rs = results()
    rs[1] = entry("sm120_hostmem", AR, None, error="mismatch vs NCCL: x")
    ts = targets_of(rs)
    assert ts[PLAIN]["met"] is None and "mismatch" in ts[PLAIN]["why"] and ts[PLAIN]["ours_us"] is None
    ts = targets_of(results(), norm_kernel="torch (unfused reference ops)")
    assert ts[FUSED]["met"] is None and "triton" in ts[FUSED]["why"] and ts[PLAIN]["met"] is True
    ts = targets_of(results(), invalid="NCCL logged P2P channels in this --no-p2p run")
    assert all(t["met"] is None and "P2P channels" in t["why"] for t in ts.values())
    assert all(t["met"] is None for t in targets_of([]).values())


def nop2p_doc(rs=None, **kw):
    rs = results() if rs is None else rs
    return {"hardware": dict(HW), "date": "2026-12-02", "results": rs, "skipped": [], "crossover_bytes": None,
            "no_p2p": True, "nccl_setup": {"mode": "no_p2p", "env_at_init": {"NCCL_P2P_DISABLE": "1"}},
            "targets": schema.evaluate_targets(rs, schema.NO_P2P_TARGETS, norm_kernel=TRITON), **kw}


def test_validator_recomputes_every_verdict():
    schema.validate_allreduce_doc(nop2p_doc())
    for mutate, says in (
        (lambda d: d["targets"][1].update(met=True), "met does not follow"),
        (lambda d: d["targets"][0].update(ours_us=1.0, speedup=35.0), "not the measured median"),
        (lambda d: d["targets"][0].update(speedup=9.9), "speedup is not"),
        (lambda d: d["targets"][0].update(met=None, why=None), "needs a why"),
        (lambda d: d["targets"][0].update(met="yes"), "met must be"),
        (lambda d: d["targets"][0].pop("peer_us"), "lacks peer_us"),
        (lambda d: d["nccl_setup"].update(env_at_init={}), "NCCL_P2P_DISABLE"),
        (lambda d: d["results"].append(entry("nccl", AR, 5.0)), "results named nccl"),
        (lambda d: d.update(no_p2p=False), "nccl_no_p2p results need"),
    ):
        bad = copy.deepcopy(nop2p_doc())
        mutate(bad)
        with pytest.raises(schema.SchemaError, match=says):
            schema.validate_allreduce_doc(bad)
    # a target that could not be judged is valid with its reason
    schema.validate_allreduce_doc(nop2p_doc(rs=[]))


def test_verify_doc_mode_checked():
    doc = {"hardware": dict(HW), "date": "2026-12-02", "config": {"name": "kimi_k25"}, "world_size": 2,
           "pattern": {"n_allreduce": 123, "n_fused": 118, "n_plain": 5}, "skipped": [],
           "results": [{"backend": "nccl_no_p2p", "compute": "none", "tokens": 3, "step_us": 900.0, "comm_us": 900.0},
                       {"backend": "sm120_hostmem", "compute": "none", "tokens": 3, "step_us": 300.0,
                        "comm_us": 300.0}],
           "no_p2p": True, "nccl_setup": {"env_at_init": {"NCCL_P2P_DISABLE": "1"}}}
    schema.validate_verify_doc(doc)
    bad = copy.deepcopy(doc)
    bad["no_p2p"] = False
    with pytest.raises(schema.SchemaError, match="nccl_no_p2p"):
        schema.validate_verify_doc(bad)
