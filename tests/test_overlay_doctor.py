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
