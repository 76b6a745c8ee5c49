"""The doctor on a machine without GPUs: reports, says "no CUDA GPUs", exits non-zero."""

from __future__ import annotations

from sglang_sm120 import doctor


def test_doctor_without_gpus(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "gpus", lambda: [])
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout=20.0: None)  # no lspci on CI runners either
    code = doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert code != 0
    assert "no CUDA GPUs" in out
    assert "NCCL_P2P_LEVEL" in out
    assert "dispatch by message size" in out and "by the routing table (sm120 or NCCL)" in out
    assert "sm120 / sm120 fused" not in out  # no size is ours before a table says so
    assert "cannot run: no CUDA GPUs" in out


def test_dispatch_table_matches_the_bound(capsys):
    from sglang_sm120.core.config import ByteBound

    doctor.dispatch_table(7168, ByteBound(3 * 7168 * 2, "three tokens"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    by_tokens = {int(line.split()[0]): line for line in lines}
    assert "sm120" in by_tokens[3] and "NCCL" in by_tokens[4]


def _quiet_machine(monkeypatch):
    monkeypatch.setattr(doctor, "gpus", lambda: [])
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout=20.0: None)


def test_doctor_reports_a_bad_variable_in_one_line_without_traceback(monkeypatch, capsys):
    from sglang_sm120.core import config

    _quiet_machine(monkeypatch)
    monkeypatch.setenv(config.MAX_BYTES_ENV, "abc")
    code = doctor.main(["--no-self-test"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "cannot run: SGLANG_SM120_ALLREDUCE_MAX_BYTES='abc' is not an integer" in out, out
    assert "Traceback" not in out + err


def test_doctor_shows_mode_off_as_off(monkeypatch, capsys):
    from sglang_sm120.core import config

    _quiet_machine(monkeypatch)
    monkeypatch.setenv(config.MODE_ENV, "off")
    doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert f"mode: off (from ${config.MODE_ENV})" in out, out
    assert "mode: auto" not in out


class _NoTopology:
    error = "no NVML here"
    levels = None
    numa_nodes = [None, None]
    nvlink_all_pairs = False
    link = "pcie"

    def islands(self):
        return None


def _fake_box(monkeypatch, name, p2p_ok):
    fake = [{"index": i, "name": name, "capability": (12, 0), "uuid": f"GPU-{i}", "memory_gib": 32.0}
            for i in range(2)]
    _quiet_machine(monkeypatch)
    monkeypatch.setattr(doctor, "gpus", lambda: fake)
    monkeypatch.setattr(doctor, "p2p_matrix", lambda n: [[i == j or p2p_ok for j in range(n)] for i in range(n)])
    monkeypatch.setattr(doctor, "cpu_affinity", lambda uuid: None)
    monkeypatch.setattr(doctor, "kernel_error", lambda: None)  # as if the kernels were built
    monkeypatch.setattr(doctor, "probe", lambda uuids: _NoTopology())
    monkeypatch.setattr(doctor, "key_facts", _key_facts)
    monkeypatch.setattr(doctor, "report_fingerprints", lambda count, timeout_s: print(f"(fingerprints of {count})"))


def _key_facts(device):
    return {"uuid": f"GPU-{device.index}", "pci_bus_id": None, "name": "fake", "driver": "580.1", "cuda": "13.0",
            "torch": "2.14.1", "nccl": "2.27.3", "sglang_sm120": "0.1.0", "kernels": "fake"}


def test_doctor_gives_geforce_cards_the_host_memory_path(monkeypatch, capsys):
    from sglang_sm120.core import config

    monkeypatch.delenv(config.HOSTMEM_ENV, raising=False)
    _fake_box(monkeypatch, "NVIDIA GeForce RTX 5090", p2p_ok=False)
    code = doctor.main(["--no-self-test", "--mode", "auto"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "TP=2 over cuda:0-1: ENABLED, path: sm120 kernels over pinned host memory (no P2P needed)" in out, out
    assert "GeForce" in out and "disables P2P" in out, out
    assert "path on this box (TP=2): sm120 kernels over pinned host memory" in out, out
    assert "host-memory workspace where P2P is missing: auto (from default)" in out, out


def test_doctor_with_hostmem_off_sends_geforce_cards_to_nccl(monkeypatch, capsys):
    from sglang_sm120.core import config

    monkeypatch.setenv(config.HOSTMEM_ENV, "off")
    _fake_box(monkeypatch, "NVIDIA GeForce RTX 5090", p2p_ok=False)
    code = doctor.main(["--no-self-test", "--mode", "auto"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "TP=2 over cuda:0-1: DISABLED, path: NCCL" in out and "SGLANG_SM120_HOSTMEM=off" in out, out
    assert "path on this box (TP=2): NCCL" in out, out


def test_doctor_names_the_p2p_path_on_a_workstation_box(monkeypatch, capsys):
    _fake_box(monkeypatch, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", p2p_ok=True)
    code = doctor.main(["--no-self-test", "--mode", "auto"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "path on this box (TP=2): sm120 kernels over CUDA IPC (P2P between every pair)" in out, out
    assert "retries in pinned host memory" in out, out


def test_doctor_self_test_retries_in_host_memory_after_a_probe_failure(monkeypatch, capsys):
    _fake_box(monkeypatch, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", p2p_ok=True)
    runs = []

    def self_test(world, hidden, timeout_s, memory="device"):
        runs.append(memory)
        return "self-test failed: rank 0: IpcAllReduceProbeError: dropped" if memory == "device" else None

    monkeypatch.setattr(doctor, "self_test", self_test)
    code = doctor.main(["--mode", "auto"])
    out = capsys.readouterr().out
    assert runs == ["device", "host"] and code == 0, out
    assert "after the P2P data-path probe failed" in out and "PASSED" in out, out


def test_doctor_reports_a_bad_hostmem_value_in_one_line(monkeypatch, capsys):
    from sglang_sm120.core import config

    _quiet_machine(monkeypatch)
    monkeypatch.setenv(config.HOSTMEM_ENV, "maybe")
    code = doctor.main(["--no-self-test"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "cannot run: SGLANG_SM120_HOSTMEM='maybe' is not a valid host-memory setting" in out, out
    assert "Traceback" not in out + err


def test_doctor_names_the_architectures_the_library_was_built_for(monkeypatch, tmp_path):
    """pip hides the build's output; setup.py leaves a record beside the library and the doctor reads it."""
    library = tmp_path / "_C_torch9_9_9_cuda13_0.cpython-311-x86_64-linux-gnu.so"
    from sgl_kernel_sm120.env import spelled_out

    for name, value in spelled_out("SGL_SM120_EXT_LIBRARY", str(library)).items():
        monkeypatch.setenv(name, value)
    assert "no record at" in doctor.build_record_line()
    record = {"archs": ["9.0a", "12.0a"], "nvcc_release": "13.0", "torch": "9.9.9+cu130"}
    (tmp_path / "_C_torch9_9_9_cuda13_0.build.json").write_text(__import__("json").dumps(record))
    line = doctor.build_record_line()
    assert "built for 9.0a;12.0a with nvcc 13.0 against torch 9.9.9+cu130" in line, line


def test_doctor_shows_the_routing_table_of_this_box_or_how_to_make_one(monkeypatch, capsys):
    from sglang_sm120.routing import cache
    from sglang_sm120.routing.table import NCCL, Point, RoutingTable, make_key

    _fake_box(monkeypatch, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", p2p_ok=True)
    assert doctor.main(["--no-self-test", "--mode", "auto", "--max-bs", "1", "--draft-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP=2, hidden 7168: no table" in out and "python -m sglang_sm120.tune --hidden 7168 --tp 2" in out, out
    assert "(fingerprints of 2)" in out
    key = make_key([_key_facts(torch_device(i)) for i in range(2)], islands=None, p2p=[[True, True], [True, True]],
                   memory="device")
    points = [Point(r, r * 14336, {NCCL: 20.0, "sm120/ONESHOT/push/device": 10.0}) for r in (1, 2)]
    table = RoutingTable.from_points(key=key, measured="2026-12-03T10:00:00Z", workload={"hidden": 7168},
                                     measurements={("bfloat16", k): points for k in ("plain", "fused")})
    path = cache.save(table)
    assert doctor.main(["--no-self-test", "--mode", "auto", "--max-bs", "1", "--draft-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert f"TP=2, hidden 7168, bf16: tuned table {path}, measured 2026-12-03T10:00:00Z" in out, out
    assert "| bfloat16 | fused | 1 | 28672 | ONESHOT/push/device |" in out, out


def torch_device(index):
    import torch

    return torch.device("cuda", index)


def test_the_fingerprints_come_from_a_child_and_a_failing_child_is_not_measured(monkeypatch, capsys):
    import json
    import subprocess

    answer = {"gpus": [0, 1], "pairs": [{"src": 0, "dst": 1, "store_gbps": 2.6, "load_gbps": 27.0}],
              "all_peers": {"store_gbps": 2.6, "load_gbps": 27.0}, "errors": []}
    calls = []

    def run(command, **kw):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="noise\n" + json.dumps(answer) + "\n", stderr="")

    monkeypatch.setattr(doctor.subprocess, "run", run)
    doctor.report_fingerprints(2, 10.0)
    out = capsys.readouterr().out
    assert calls[0][1:] == ["-m", "sglang_sm120.tuning.fabric_probe", "--gpus", "0,1"]
    assert "=> posted-write collapse: with every GPU writing to all its peers at once" in out, out

    def crash(command, **kw):
        return subprocess.CompletedProcess(command, -11, stdout="", stderr="Segmentation fault")

    monkeypatch.setattr(doctor.subprocess, "run", crash)
    doctor.report_fingerprints(2, 10.0)
    assert "not measured: the probe failed (exit code -11): Segmentation fault" in capsys.readouterr().out

    def hang(command, timeout, **kw):
        raise subprocess.TimeoutExpired(command, timeout)

    monkeypatch.setattr(doctor.subprocess, "run", hang)
    doctor.report_fingerprints(2, 10.0)
    assert "not measured: the probe did not finish within 10 s" in capsys.readouterr().out


def test_without_gpus_the_doctor_names_the_fix(monkeypatch, capsys):
    _quiet_machine(monkeypatch)
    doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    fix = "check `nvidia-smi` (the NVIDIA driver must be >= 580, CUDA 13) and CUDA_VISIBLE_DEVICES"
    assert f"no CUDA GPUs visible to torch: {fix}" in out and f"cannot run: no CUDA GPUs: {fix}" in out


def test_the_bound_says_which_rows_are_assumed_defaults_and_which_flags_change_them(monkeypatch, capsys):
    _quiet_machine(monkeypatch)
    doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert "bound: 1835008 B" in out
    assert "assumed 32 x 4 rows (--max-bs 32, --draft-tokens 4): this tool's defaults, not your server's; " \
           "a server's rows are its largest captured CUDA-graph batch (--cuda-graph-max-bs, or the largest of " \
           "--cuda-graph-bs; SGLang 0.5.23 counts the batches it captures, clamped to its request pool) times " \
           "--speculative-num-draft-tokens when a --speculative-algorithm is set; --max-bs and --draft-tokens " \
           "change them here; --max-bytes here, or --sm120-allreduce-max-bytes or " \
           "$SGLANG_SM120_ALLREDUCE_MAX_BYTES on a server, sets the bound itself (a derived one is capped at " \
           "8388608 B)" in out, out
    doctor.main(["--no-self-test", "--max-bs", "8"])
    out = capsys.readouterr().out
    assert "assumed 8 x 4 rows (--draft-tokens 4)" in out
    doctor.main(["--no-self-test", "--max-bs", "8", "--draft-tokens", "2"])
    assert "assumed" not in capsys.readouterr().out


def test_the_routing_table_section_finds_a_table_whatever_its_launch_facts(monkeypatch, capsys, tmp_path):
    from sglang_sm120.core.config import ByteBound
    from sglang_sm120.routing import cache
    from sglang_sm120.routing.table import NCCL, Point, RoutingTable, make_key

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    local = [{"uuid": f"GPU-{i}", "driver": "580"} for i in range(2)]
    monkeypatch.setattr(doctor, "key_facts", lambda device: local[device.index])
    matrix = [[True, True], [True, True]]
    doctor.report_routing_table(2, "host", matrix, ["GPU-0", "GPU-1"], 7168, ByteBound(2 * 14336, "t"))
    out = capsys.readouterr().out
    assert "no table" in out and "if that fails, sends every size to NCCL" in out and "seeds" in out
    launch = {"clusters": [2], "sm_budget": 188, "pdl": True, "switches": {}}
    key = make_key(local, islands=None, p2p=matrix, memory="host", launch=launch)
    points = [Point(r, r * 14336, {NCCL: 20.0, "sm120/ONESHOT/push/host": 10.0}) for r in (1, 2)]
    cache.save(RoutingTable.from_points(key, "2026-12-03T10:00:00Z", {"hidden": 7168},
                                        {("bfloat16", k): points for k in ("plain", "fused")}))
    doctor.report_routing_table(2, "host", matrix, ["GPU-0", "GPU-1"], 7168, ByteBound(2 * 14336, "t"))
    out = capsys.readouterr().out
    assert "tuned table" in out and "measured with the workspace launching {'clusters': [2]" in out, out
