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
    assert "dispatch by message size" in out and "sm120 / sm120 fused" in out
    assert "cannot run: no CUDA GPUs" in out


def test_dispatch_table_matches_the_bound(capsys):
    from sglang_sm120.config import ByteBound

    doctor.dispatch_table(7168, ByteBound(3 * 7168 * 2, "three tokens"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    by_tokens = {int(line.split()[0]): line for line in lines}
    assert "sm120" in by_tokens[3] and "NCCL" in by_tokens[4]


def _quiet_machine(monkeypatch):
    monkeypatch.setattr(doctor, "gpus", lambda: [])
    monkeypatch.setattr(doctor, "_run", lambda cmd, timeout=20.0: None)


def test_doctor_reports_a_bad_variable_in_one_line_without_traceback(monkeypatch, capsys):
    from sglang_sm120 import config

    _quiet_machine(monkeypatch)
    monkeypatch.setenv(config.MAX_BYTES_ENV, "abc")
    code = doctor.main(["--no-self-test"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "cannot run: SGLANG_SM120_ALLREDUCE_MAX_BYTES='abc' is not an integer" in out, out
    assert "Traceback" not in out + err


def test_doctor_shows_mode_off_as_off(monkeypatch, capsys):
    from sglang_sm120 import config

    _quiet_machine(monkeypatch)
    monkeypatch.setenv(config.MODE_ENV, "off")
    doctor.main(["--no-self-test"])
    out = capsys.readouterr().out
    assert f"mode: off (from ${config.MODE_ENV})" in out, out
    assert "mode: auto" not in out


def test_doctor_gate_names_geforce_cards(monkeypatch, capsys):
    fake = [{"index": i, "name": "NVIDIA GeForce RTX 5090", "capability": (12, 0), "uuid": f"GPU-{i}",
             "memory_gib": 32.0} for i in range(2)]
    _quiet_machine(monkeypatch)
    monkeypatch.setattr(doctor, "gpus", lambda: fake)
    monkeypatch.setattr(doctor, "p2p_matrix", lambda n: [[i == j for j in range(n)] for i in range(n)])
    monkeypatch.setattr(doctor, "cpu_affinity", lambda uuid: None)

    class NoTopology:
        error = "no NVML here"
        levels = None
        numa_nodes = [None, None]
        nvlink_all_pairs = False
        link = "pcie"

        def islands(self):
            return None

    monkeypatch.setattr(doctor, "probe", lambda uuids: NoTopology())
    code = doctor.main(["--no-self-test", "--mode", "auto"])
    out = capsys.readouterr().out
    assert code == 1
    assert "TP=2 over cuda:0-1: DISABLED" in out and "GeForce" in out and "disables P2P" in out, out
