"""The doctor on machines it can only pretend to see: no GPU, a GeForce pair, a workstation pair; its settings
errors, bound, routing-table section, NCCL section and report."""

from __future__ import annotations

import json
import os

import pytest

from sglang_sm120 import doctor
from sglang_sm120.core import config

FIX = "check `nvidia-smi` (the NVIDIA driver must be >= 580, CUDA 13) and CUDA_VISIBLE_DEVICES"


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch, clean_env):
    monkeypatch.setattr(os, "environ", os.environ.copy())  # the doctor sets a server's NCCL_* variables in it
    monkeypatch.setattr(doctor, "gpus", lambda: [])
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout=20.0: None)  # no lspci, nvidia-smi on CI runners
    monkeypatch.setattr(doctor.nccl_check, "run", lambda **kw: {"skipped": "NCCL check: stand-in (nothing was run)"})


class _NoTopology:
    error, levels, numa_nodes, nvlink_all_pairs, link = "no NVML here", None, [None, None], False, "pcie"

    def islands(self):
        return None


def _key_facts(device):
    return {"uuid": f"GPU-{device.index}", "pci_bus_id": None, "name": "fake", "driver": "580.1", "cuda": "13.0",
            "torch": "2.14.1", "nccl": "2.27.3", "nccl_settings": {}, "sglang_sm120": "0.1.0", "kernels": "fake"}


def _fake_box(monkeypatch, name, p2p_ok):
    fake = [{"index": i, "name": name, "capability": (12, 0), "uuid": f"GPU-{i}", "memory_gib": 32.0}
            for i in range(2)]
    monkeypatch.setattr(doctor, "gpus", lambda: fake)
    monkeypatch.setattr(doctor, "p2p_matrix", lambda n: [[i == j or p2p_ok for j in range(n)] for i in range(n)])
    monkeypatch.setattr(doctor, "cpu_affinity", lambda uuid: None)
    monkeypatch.setattr(doctor, "kernel_error", lambda: None)  # as if the kernels were built
    monkeypatch.setattr(doctor, "probe", lambda uuids: _NoTopology())
    monkeypatch.setattr(doctor, "key_facts", _key_facts)


def test_without_gpus_the_doctor_names_the_fix_and_exits_non_zero(capsys):
    code = doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert code == 1
    assert f"no CUDA GPUs visible to torch: {FIX}" in out and f"cannot run: no CUDA GPUs: {FIX}" in out
    assert "by the routing table (sm120 or NCCL)" in out and "(measured with GPUs: `python -m sglang_sm120.tune`)" \
        in out
    assert "== routing table" not in out and "section 'routing table'" not in out, out  # no pointer to a lost section


def test_the_dispatch_table_follows_the_bound(capsys):
    doctor.dispatch_table(7168, config.ByteBound(3 * 7168 * 2, "three tokens"))
    rows = {int(line.split()[0]): line for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()}
    assert "routing table" in rows[3] and "NCCL" in rows[4]


@pytest.mark.parametrize("name, value, said", [
    (config.MAX_BYTES_ENV, "abc", "SGLANG_SM120_ALLREDUCE_MAX_BYTES='abc': a byte count from 16"),
    (config.HOSTMEM_ENV, "maybe", "SGLANG_SM120_HOSTMEM='maybe': one of auto, off"),
    ("SGL_SM120_AR_TIMEOUT_S", "-5", "SGL_SM120_AR_TIMEOUT_S='-5': a number of seconds > 0"),
    ("SGLANG_SM120_SHM_DIR", "/no/such/folder", "SGLANG_SM120_SHM_DIR='/no/such/folder': an existing folder"),
])
def test_a_bad_setting_is_one_line_without_a_traceback_as_at_launch(monkeypatch, capsys, name, value, said):
    monkeypatch.setenv(name, value)
    code = doctor.main(["--no-self-test"])
    out, err = capsys.readouterr()
    assert code == 1 and f"cannot run: {said}" in out, out
    assert "Traceback" not in out + err


def test_one_setting_at_two_values_under_its_two_spellings_is_an_error(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_SM120_ALLREDUCE", "on")
    monkeypatch.setenv("SGL_SM120_ALLREDUCE", "off")
    assert doctor.main(["--no-self-test"]) == 1
    assert "SGL_SM120_ALLREDUCE='off' and SGLANG_SM120_ALLREDUCE='on' are one setting at two values" in \
        capsys.readouterr().out


@pytest.mark.parametrize("argv, said", [
    (["--hidden", "-1"], "--hidden='-1': an integer >= 1"),
    (["--draft-tokens", "0"], "--draft-tokens='0': an integer >= 1"),
    (["--max-bs", "0"], "--max-bs='0': an integer >= 1"),
    (["--vocab", "x"], "--vocab='x': an integer >= 1"),
    (["--max-bytes", "8"], "--max-bytes='8': a byte count from 16"),
    (["--nccl-timeout", "0"], "--nccl-timeout='0': a number of seconds > 0"),
    (["--self-test-timeout", "-3"], "--self-test-timeout='-3': a number of seconds > 0"),
])
def test_a_bad_argument_stops_the_doctor_in_one_line_before_it_runs(monkeypatch, capsys, argv, said):
    """--hidden -1 used to give a bound of -256 B; --draft-tokens 0 printed 32 x 0 rows and computed 32 x 1."""
    monkeypatch.setattr(doctor, "diagnose", lambda *a: pytest.fail("the doctor ran"))
    with pytest.raises(SystemExit) as caught:
        doctor.main([*argv, "--no-self-test"])
    out, err = capsys.readouterr()
    assert caught.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: argument {argv[0]}: {said}"), err


def test_mode_off_is_shown_as_off(monkeypatch, capsys):
    monkeypatch.setenv(config.MODE_ENV, "off")
    doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert f"mode: off (from ${config.MODE_ENV})" in out and "mode: auto" not in out, out


def test_geforce_cards_get_the_host_memory_path_unless_it_is_refused(monkeypatch, capsys):
    _fake_box(monkeypatch, "NVIDIA GeForce RTX 5090", p2p_ok=False)
    assert doctor.main(["--no-self-test", "--mode", "auto"]) == 0
    out = capsys.readouterr().out
    assert "TP=2 over cuda:0-1: ENABLED, path: sm120 kernels over pinned host memory (no P2P needed)" in out, out
    assert "GeForce" in out and "disables P2P" in out and "host-memory workspace where P2P is missing: auto" in out
    monkeypatch.setenv(config.HOSTMEM_ENV, "off")
    assert doctor.main(["--no-self-test", "--mode", "auto"]) == 1
    out = capsys.readouterr().out
    assert "TP=2 over cuda:0-1: DISABLED, path: NCCL" in out and "SGLANG_SM120_HOSTMEM=off" in out, out


def test_a_workstation_pair_gets_cuda_ipc_and_the_self_test_retries_in_host_memory_like_a_server(monkeypatch,
                                                                                                capsys):
    _fake_box(monkeypatch, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", p2p_ok=True)
    runs = []

    def self_test(world, hidden, timeout_s, memory="device"):
        runs.append(memory)
        return "self-test failed: rank 0: IpcAllReduceProbeError: dropped" if memory == "device" else None

    monkeypatch.setattr(doctor, "self_test", self_test)
    assert doctor.main(["--mode", "auto"]) == 0
    out = capsys.readouterr().out
    assert "path: sm120 kernels over CUDA IPC (P2P between every pair)" in out, out
    assert runs == ["device", "host"] and "retrying as a server would" in out and "PASSED" in out, out


def test_the_doctor_names_the_architectures_the_library_was_built_for(monkeypatch, tmp_path):
    from sgl_kernel_sm120 import _ext

    library = tmp_path / "_C_torch9_9_9_cuda13_0.cpython-311-x86_64-linux-gnu.so"
    monkeypatch.setattr(_ext, "library_path", lambda: str(library))
    assert "no record" in doctor.build_record_line()
    record = {"archs": ["9.0a", "12.0a"], "nvcc_release": "13.0", "torch": "9.9.9+cu130"}
    (tmp_path / "_C_torch9_9_9_cuda13_0.build.json").write_text(json.dumps(record))
    assert "built for 9.0a;12.0a with nvcc 13.0 against torch 9.9.9+cu130" in doctor.build_record_line()


def test_the_routing_table_section_shows_this_boxs_table_or_how_a_launch_makes_one(monkeypatch, capsys):
    import torch

    from sglang_sm120.routing import cache
    from sglang_sm120.routing.table import NCCL, Point, RoutingTable, make_key

    _fake_box(monkeypatch, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", p2p_ok=True)
    assert doctor.main(["--no-self-test", "--mode", "auto"]) == 0
    out = capsys.readouterr().out
    assert "TP=2, hidden 7168: no routing table of this box" in out, out
    assert "python -m sglang_sm120.tune --hidden 7168 --tp 2" in out and "--sm120-allreduce-tune auto" in out, out
    launch = {"clusters": [2], "sm_budget": 188, "pdl": True, "switches": {}}
    key = make_key([_key_facts(torch.device("cuda", i)) for i in range(2)], islands=None,
                   p2p=[[True, True], [True, True]], memory="device", launch=launch)
    points = [Point(r, r * 14336, {NCCL: 20.0, "sm120/ONESHOT/push/device": 10.0}) for r in (1, 2)]
    path = cache.save(RoutingTable.from_points(key, "2026-12-03T10:00:00Z", {"hidden": 7168},
                                               {("bfloat16", k): points for k in ("plain", "fused")}))
    assert doctor.main(["--no-self-test", "--mode", "auto"]) == 0
    out = capsys.readouterr().out
    assert f"tuned table {path}, measured 2026-12-03T10:00:00Z, with the workspace launching {{'clusters': [2]" \
        in out, out
    assert "| bfloat16 | fused | 1 | 28672 | ONESHOT/push/device |" in out, out


def test_the_nccl_section_prints_the_checks_lines(monkeypatch, capsys):
    _fake_box(monkeypatch, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", p2p_ok=True)
    asked = []
    monkeypatch.setattr(doctor.nccl_check, "run", lambda **kw: asked.append(kw) or {"skipped": "the check's line"})
    doctor.main(["--no-self-test", "--mode", "auto", "--hidden", "4096", "--vocab", "32768"])
    out = capsys.readouterr().out
    assert "== NCCL at the verify sizes" in out and "the check's line" in out
    assert asked == [{"hidden": 4096, "vocab": 32768, "timeout_s": 300.0}]
    doctor.main(["--no-self-test", "--mode", "auto", "--no-nccl-check"])
    assert "== NCCL at the verify sizes" not in capsys.readouterr().out


def test_the_bound_says_which_rows_are_assumed_defaults(capsys):
    doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert "bound: 1835008 B" in out and "assumed 32 x 4 rows (--max-bs 32, --draft-tokens 4): this tool's defaults" \
        in out, out
    doctor.main(["--no-self-test", "--max-bs", "8"])
    assert "assumed 8 x 4 rows (--draft-tokens 4)" in capsys.readouterr().out
    doctor.main(["--no-self-test", "--max-bs", "8", "--draft-tokens", "2"])
    assert "assumed" not in capsys.readouterr().out


def test_a_report_path_that_cannot_be_written_stops_the_doctor_before_it_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(doctor, "diagnose", lambda *a: pytest.fail("the doctor ran"))
    for path in (tmp_path / "no" / "such" / "r.md", tmp_path):
        with pytest.raises(SystemExit) as caught:
            doctor.main(["--no-self-test", "--report", str(path)])
        err = capsys.readouterr().err
        assert caught.value.code == 2 and err == f"error: argument --report: --report={str(path)!r}: a file this " \
            "user can write, in a folder that exists\n", err


def test_a_report_that_fails_to_write_after_the_run_is_one_line(monkeypatch, capsys, tmp_path):
    def write_report(path, output):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(doctor, "write_report", write_report)
    assert doctor.main(["--no-self-test", "--report", str(tmp_path / "r.md")]) == 1
    out, err = capsys.readouterr()
    assert f"report not written: [Errno 13] Permission denied: '{tmp_path / 'r.md'}'" in out, out
    assert "Traceback" not in out + err


def test_the_report_holds_the_output_the_environment_and_no_host_name(monkeypatch, tmp_path, capsys):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "box17")
    monkeypatch.setenv("NCCL_P2P_LEVEL", "SYS")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    report = tmp_path / "report.md"
    doctor.main(["--no-self-test", "--report", str(report)])
    assert f"report written to {report}" in capsys.readouterr().out
    text = report.read_text()
    assert "no CUDA GPUs visible to torch" in text and "NCCL_P2P_LEVEL=SYS" in text
    assert "UNRELATED_SECRET" not in text and "box17" not in text


def test_the_doctor_sees_nccl_as_a_server_runs_it(capsys):
    """SGLang's launcher sets NCCL_* variables before its ranks start: the doctor's NCCL check and its table key
    use them as well (one the user set stays)."""
    from sglang_sm120 import seams

    for name in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_GRAPH_REGISTER"):
        os.environ.pop(name, None)
    os.environ["NCCL_NVLS_ENABLE"] = "1"
    assert doctor.main(["--no-self-test"]) == 1
    release = seams.sglang_version()
    assert f"NCCL as an SGLang {release} server runs it: NCCL_CUMEM_ENABLE=0" in capsys.readouterr().out
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0" and os.environ["NCCL_NVLS_ENABLE"] == "1"
    assert os.environ.get("NCCL_GRAPH_REGISTER") == ("0" if release == "0.5.23" else None)
