"""The NCCL check on CPU: the parser on NCCL's INFO lines of two releases (each line written from the format string
in NCCL's source, cited next to it), the variant plan, the advice on stand-in timings, the slowest-rank median, the
one-GPU message, and the spawn / collect / timeout path with stand-in rank processes (nccl_stand_in_rank.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from sglang_sm120 import nccl_check
from sglang_sm120.core import nccl

STAND_IN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nccl_stand_in_rank.py")


def _two_ranks(mode: str, environ: dict, timeout_s: float = 60) -> dict:
    return nccl_check.run(world=2, devices=2, environ={**environ, "STAND_IN_MODE": mode},
                          rank_command=[sys.executable, STAND_IN], timeout_s=timeout_s)


# NCCL v2.18.5-1. Prefix "%s:%d:%d [%d] NCCL INFO " (hostname:pid:tid [cudaDev]): src/debug.cc, ncclDebugLog.
LOG_2_18 = """\
box:11:11 [0] NCCL INFO NCCL version 2.18.5+cuda12.2
box:11:11 [0] NCCL INFO NCCL_P2P_LEVEL set by environment to SYS
box:11:11 [0] NCCL INFO Channel 00/02 :  0 1 2
box:11:40 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC/read
box:11:40 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM
box:12:41 [1] NCCL INFO Channel 00 : 1[1] -> 2[2] via SHM/direct/direct
box:12:41 [1] NCCL INFO Channel 01 : 1[1] -> 2[2] via SHM/CE/direct
box:13:42 [2] NCCL INFO Channel 00/0 : 2[2] -> 0[0] [send] via NET/Socket/0
box:11:40 [0] NCCL INFO Channel 00/0 : 2[2] -> 0[0] [receive] via NET/Socket/0/GDRDMA
box:11:40 [0] NCCL INFO CollNet 00/0 : 0 [send] via COLLNET/SHARP/0
box:11:40 [0] NCCL INFO Connected all rings
"""
# line by line: init.cc:455 (INFO(NCCL_ALL, VERSION_STRING)); graph/paths.cc:242; graph/rings.cc:35 (ring order,
# not a connection); transport/p2p.cc:366 ("via P2P/IPC%s%s", "/read"); p2p.cc:361 ("via P2P/CUMEM%s%s");
# transport/shm.cc:95 ("Channel %02d : ... via SHM/%s/%s", twice); transport/net.cc:186 ("[send] via NET/%s/%d%s%s");
# net.cc:227 ("[receive] via NET/%s/%d%s%s": the peer is the source); transport/coll_net.cc:165; init.cc:1080.

# NCCL v2.28.9-1. Prefix: optional timestamp (here NCCL_DEBUG_TIMESTAMP_LEVELS=INFO with the format "[%T] "), then
# "%s:%d:%d " and "[%d] NCCL INFO ": src/debug.cc, ncclDebugLog.
LOG_2_28 = """\
box:21:21 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
box:21:21 [0] NCCL INFO Channel 00/02 : 0 1
[12:00:01] box:21:50 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
box:21:50 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/direct pointer/read
box:22:51 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/MNNVL/CE
box:22:51 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via P2P/indirect/0[0]/read
box:22:51 [1] NCCL INFO Channel 02 : 1[1] -> 0[0] via SHM/direct/direct
box:22:51 [1] NCCL INFO Channel 00/1 : 1[1] -> 0[0] [send] via NET/IB/0(0)/GDRDMA(PCI)/Shared
box:21:50 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 0
"""
# line by line: init.cc:608; graph/rings.cc:47; transport/p2p.cc:393 ("via P2P/%s%s%s", CUMEM); p2p.cc:386
# ("via P2P/direct pointer%s"); p2p.cc:393 again (MNNVL, "/CE"); p2p.cc:406 ("via P2P/indirect/%d[%d]%s");
# transport/shm.cc:128; transport/net.cc:317 ("[send] via NET/%s/%d(%d)%s%s%s", through a proxy rank);
# transport/generic.cc:37.
SHM_2_30 = "box:31:60 [3] NCCL INFO Channel 05 : 3[3] -> 2[2] via SHM/direct\n"  # v2.30.7-1 transport/shm.cc:116


def test_parse_2_18():
    got = nccl.parse_log(LOG_2_18)
    assert got["nccl_version"] == "2.18.5+cuda12.2"
    assert got["pairs"] == {"0->1": {"P2P/IPC/read": 1, "P2P/CUMEM": 1},
                            "1->2": {"SHM/direct/direct": 1, "SHM/CE/direct": 1},
                            "2->0": {"NET/Socket/0": 1, "NET/Socket/0/GDRDMA": 1},
                            "0->collnet": {"COLLNET/SHARP/0": 1}}
    assert nccl.pairs_by_kind(got["pairs"]) == {"COLLNET": ["0->collnet"], "P2P": ["0->1"], "SHM": ["1->2"],
                                                "NET": ["2->0"]}


def test_parse_2_28_and_2_30():
    got = nccl.parse_log(LOG_2_28)
    assert got["nccl_version"] == "2.28.9+cuda13.0"
    assert got["pairs"] == {"0->1": {"P2P/CUMEM/read": 1, "P2P/direct pointer/read": 1},
                            "1->0": {"P2P/MNNVL/CE": 1, "P2P/indirect/0[0]/read": 1, "SHM/direct/direct": 1,
                                     "NET/IB/0(0)/GDRDMA(PCI)/Shared": 1}}
    assert nccl.pairs_by_kind(got["pairs"]) == {"P2P": ["0->1", "1->0"], "NET": ["1->0"], "SHM": ["1->0"]}
    assert [nccl.kind(v) for v in got["pairs"]["1->0"]] == ["P2P", "P2P", "SHM", "NET"]
    assert nccl.parse_log(SHM_2_30) == {"nccl_version": None, "pairs": {"3->2": {"SHM/direct": 1}}}
    assert nccl.parse_log("box:1:1 [0] NCCL INFO Channel 00/02 : 0 1\n")["pairs"] == {}


def test_several_ranks_logs_read_together():  # pairs in order of source rank
    got = nccl.parse_log(LOG_2_28 + LOG_2_28.replace("box:2", "box:3"))
    assert got["pairs"]["0->1"] == {"P2P/CUMEM/read": 2, "P2P/direct pointer/read": 2}
    assert got["nccl_version"] == "2.28.9+cuda13.0"
    assert list(nccl.parse_log(SHM_2_30 + LOG_2_18)["pairs"]) == ["0->collnet", "0->1", "1->2", "2->0", "3->2"]


def test_settings_are_every_nccl_variable_sorted():
    env = {"PATH": "/bin", "NCCL_P2P_LEVEL": "SYS", "NCCL_ALGO": "Ring", "TORCH_NCCL_X": "1"}
    assert list(nccl.settings(env).items()) == [("NCCL_ALGO", "Ring"), ("NCCL_P2P_LEVEL", "SYS")]


@pytest.mark.parametrize("env, plan", [
    ({}, ["NCCL_P2P_LEVEL=SYS"]),
    ({"NCCL_P2P_LEVEL": "SYS"}, []),
    ({"NCCL_P2P_LEVEL": "4"}, []),  # old-style number 4 is SYS
    ({"NCCL_P2P_LEVEL": "PXB"}, ["NCCL_P2P_LEVEL=SYS"]),
    ({"NCCL_P2P_LEVEL": "sys"}, ["NCCL_P2P_LEVEL=SYS"]),  # NCCL compares with strcmp: not SYS
    ({"NCCL_P2P_DISABLE": "1"}, ["unset NCCL_P2P_DISABLE", "unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL=SYS"]),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "SYS"}, ["unset NCCL_P2P_DISABLE"]),
    ({"NCCL_P2P_DISABLE": "0"}, ["NCCL_P2P_LEVEL=SYS"]),  # only 1 disables (strtol(...) == 1)
    ({"NCCL_P2P_DISABLE": "2", "NCCL_P2P_LEVEL": "SYS"}, []),
])
def test_variant_plan(env, plan):
    assert nccl.variant_plan(env) == plan


def test_changes_and_apply():
    v = "unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL=SYS"
    assert nccl.changes(v) == {"NCCL_P2P_DISABLE": None, "NCCL_P2P_LEVEL": "SYS"}
    assert nccl.changes(nccl.BASE) == {}
    assert nccl.apply(v, {"NCCL_P2P_DISABLE": "1", "A": "b"}) == {"A": "b", "NCCL_P2P_LEVEL": "SYS"}
    assert nccl.Advice(v, "x").commands == ["unset NCCL_P2P_DISABLE", "export NCCL_P2P_LEVEL=SYS"]


SYS = "NCCL_P2P_LEVEL=SYS"
SHM = {"0->1": {"SHM/direct/direct": 2}, "1->0": {"SHM/direct/direct": 2}}
P2P = {"0->1": {"P2P/CUMEM/read": 2}, "1->0": {"P2P/CUMEM/read": 2}}


def _times(*us):
    return dict(zip(["1x7168", "4x7168", "16x7168", "64x7168"], us, strict=True))


def test_advice_when_a_variant_pays():
    got = nccl.advice({nccl.BASE: _times(200, 210, 230, 300), SYS: _times(20, 21, 25, 60)}, {}, None)
    assert [a.variant for a in got] == [SYS]
    assert "at least 5.0x" in got[0].why  # the smallest ratio over the sizes: 300 / 60
    assert "`export NCCL_P2P_LEVEL=SYS`" in got[0].line and "sglang serve" in got[0].line


def test_no_advice_when_the_change_does_not_pay():
    same = {nccl.BASE: _times(20, 21, 25, 60), SYS: _times(19, 20, 24, 58)}
    assert nccl.advice(same, {nccl.BASE: P2P, SYS: P2P}, True) == []
    # 2x at three sizes but 1.2x at the fourth: not at every verify size
    mixed = {nccl.BASE: _times(40, 40, 40, 60), SYS: _times(20, 20, 20, 50)}
    assert nccl.advice(mixed, {}, True) == []
    # host memory is NCCL's only way when CUDA P2P does not work between the GPUs: nothing to advise
    assert nccl.advice(same, {nccl.BASE: SHM, SYS: SHM}, False) == []
    assert nccl.advice({SYS: _times(1, 1, 1, 1)}, {}, True) == []  # nothing measured as is: nothing to compare


def test_advice_when_nccl_takes_host_memory_while_p2p_works():
    same = {nccl.BASE: _times(20, 21, 25, 60), SYS: _times(19, 20, 24, 58)}
    got = nccl.advice(same, {nccl.BASE: SHM, SYS: P2P}, True)
    assert [a.variant for a in got] == [SYS] and "SHM for 0->1 1->0" in got[0].why and "1.0x" in got[0].why
    net = {"0->1": {"NET/Socket/0": 1}}
    assert nccl.advice(same, {nccl.BASE: net, SYS: P2P}, True)[0].variant == SYS
    stuck = nccl.advice({nccl.BASE: _times(20, 21, 25, 60)}, {nccl.BASE: SHM}, True)  # nothing left to try
    assert stuck[0].variant is None and stuck[0].commands == [] and "IOMMU" in stuck[0].line


def test_advice_picks_the_fastest_variant():
    both = "unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL=SYS"
    got = nccl.advice({nccl.BASE: _times(300, 300, 300, 300), "unset NCCL_P2P_DISABLE": _times(100, 100, 100, 100),
                       both: _times(20, 20, 20, 20)}, {}, None)
    assert [a.variant for a in got] == [both]


def test_slowest_rank_median():
    from sglang_sm120.tuning.timing import aggregate_iteration_times

    # per replay the slowest rank: [4, 5, 6] -> 5 (the median of each rank's median would give 4)
    assert aggregate_iteration_times([[1.0, 5.0, 3.0], [4.0, 2.0, 6.0]])["median_us"] == 5.0
    with pytest.raises(ValueError):
        aggregate_iteration_times([[1.0, 2.0], [1.0]])


def test_one_gpu_says_so_and_starts_nothing(monkeypatch):
    monkeypatch.setattr(nccl_check, "_run_variant", lambda *a, **k: pytest.fail("rank processes were started"))
    for gpus in (0, 1):
        result = nccl_check.run(devices=gpus)
        assert nccl_check.report_lines(result) == [f"NCCL check: needs two GPUs, this machine has {gpus} "
                                                   "(nothing was run)"]
    assert nccl_check.run(world=4, devices=2)["skipped"] == "NCCL check: runs 2 to 2 ranks (one per GPU), not 4 " \
        "(nothing was run)"
    assert "runs 2 to 8 ranks (one per GPU), not 1" in nccl_check.run(world=1, devices=8)["skipped"]


def test_the_command_with_no_gpu_visible():  # torch's own device count, on any machine
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    got = subprocess.run([sys.executable, "-m", "sglang_sm120.nccl_check"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert (got.returncode, got.stdout) == (1, "NCCL check: needs two GPUs, this machine has 0 (nothing was run)\n")


def test_the_exit_code_says_whether_nccl_was_timed_as_configured(monkeypatch, capsys):
    """As the doctor's: 1 when nothing could be measured with the environment as it is."""
    timed = {"variant": nccl.BASE, "error": None, "times_us": {}, "transports": {}, "nccl_version": None}
    for result, code in (({"skipped": "NCCL check: needs two GPUs"}, 1),
                         ({"skipped": None, "variants": [{**timed, "error": "a rank failed"}]}, 1),
                         ({"skipped": None, "variants": [timed]}, 0)):
        monkeypatch.setattr(nccl_check, "run", lambda *a, result=result: result)
        monkeypatch.setattr(nccl_check, "report_lines", lambda r: ["the report"])
        assert nccl_check.main([]) == code


def test_help_says_what_the_check_does_in_whole_sentences_and_bad_numbers_stop_in_one_line(capsys):
    with pytest.raises(SystemExit):
        nccl_check.main(["--help"])
    described = capsys.readouterr().out.split("\n\n")[1]
    assert described.startswith("Is NCCL itself slow here?") and described.endswith("or NCCL failed)."), described
    for argv, said in ((["--hidden", "0"], "--hidden='0': an integer >= 1"),
                       (["--timeout", "soon"], "--timeout='soon': a number of seconds > 0")):
        with pytest.raises(SystemExit) as caught:
            nccl_check.main(argv)
        assert caught.value.code == 2 and capsys.readouterr().err.startswith(f"error: argument {argv[0]}: {said}")


def test_stand_in_ranks_end_to_end():
    result = _two_ranks("ok", {"NCCL_P2P_DISABLE": "1"}, 120)
    assert [v["variant"] for v in result["variants"]] == [nccl.BASE, "unset NCCL_P2P_DISABLE",
                                                         "unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL=SYS"]
    base, unset, both = result["variants"]
    assert not any(v["error"] for v in result["variants"])
    # the stand-in logs SHM unless its environment lets P2P cross the CPU: so each variant's env reached it
    assert base["transports"] == {"0->1": {"SHM/direct/direct": 2}, "1->0": {"SHM/direct/direct": 2}}
    assert unset["transports"] == base["transports"]
    assert both["transports"] == {"0->1": {"P2P/CUMEM/read": 2}, "1->0": {"P2P/CUMEM/read": 2}}
    assert base["nccl_version"] == "2.28.9+cuda13.0" and result["p2p_works"] is True
    # rank r's stand-in times are base + r + (replay % 3): the slowest rank (1) per replay, median over replays
    assert base["times_us"]["1x7168"] == 202.0 and both["times_us"]["all-gather 4x81920"] == 22.0
    assert len(result["advice"]) == 1 and "SHM for 0->1 1->0" in result["advice"][0]
    assert "`unset NCCL_P2P_DISABLE; export NCCL_P2P_LEVEL=SYS`" in result["advice"][0]
    assert json.loads(json.dumps(result)) == result
    lines = nccl_check.report_lines(result)
    assert "1x7168" in lines[1] and "all-gather 4x81920" in lines[1] and "202.0" in lines[2]
    assert any(line.startswith("  transports, as is: SHM 0->1 1->0") for line in lines)


def test_no_advice_line_when_nccl_is_fine():
    result = _two_ranks("ok", {"NCCL_P2P_LEVEL": "SYS"}, 60)
    assert len(result["variants"]) == 1 and result["advice"] == []
    assert nccl_check.report_lines(result)[-1].startswith("NCCL: no change advised")


def test_a_variant_with_wrong_results_is_not_advised():
    result = _two_ranks("wrong", {}, 60)
    base, sys_level = result["variants"]
    assert base["error"] is None and sys_level["error"] == (
        "NCCL's results were wrong (1x7168, 4x7168, 16x7168, 64x7168, all-gather 4x81920): not a setting to use")
    # the detour through SHM is still named, with nothing to set: the causes to look into
    assert len(result["advice"]) == 1 and "SHM for 0->1 1->0" in result["advice"][0]
    assert "IOMMU" in result["advice"][0] and "export" not in result["advice"][0]


def test_a_hung_nccl_is_killed_and_said():
    t0 = time.monotonic()
    result = _two_ranks("hang", {}, 2)
    assert time.monotonic() - t0 < 10
    assert "did not finish within 1 s: its processes were killed" in result["variants"][0]["error"]
    later = result["variants"][1]["error"]  # given what was left of the 2 s: killed too, or not run
    assert "did not finish within" in later or "not run" in later
    lines = nccl_check.report_lines(result)
    assert result["advice"] == [] and "did not finish" in lines[2] and "nothing can be advised" in lines[-1]


def test_a_crashed_rank_ends_the_others(monkeypatch):
    monkeypatch.setattr(nccl_check, "GRACE_S", 0.5)
    result = _two_ranks("crash", {"NCCL_P2P_LEVEL": "SYS"}, 60)
    err = result["variants"][0]["error"]
    assert "a rank failed" in err and "rank 1 exited with code 3 (stand-in rank failing)" in err


def test_wait_all_kills_the_whole_group():
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
             for _ in range(2)]
    assert "did not finish within" in nccl_check.wait_all(procs, 0.3)
    assert all(p.poll() == -9 for p in procs)
    quick = [subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)]
    assert nccl_check.wait_all(quick, 30) == ""
