"""The launcher's tune: the command it runs for a server, when it runs none, and that a launch goes on whatever the
tune does."""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import pytest

from sglang_sm120.core.config import OverlaySettings
from sglang_sm120.hooks import startup


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168}}))
    return str(tmp_path)


def server_args(model, **fields):
    base = dict(model_path=model, tp_size=8, nnodes=1, base_gpu_id=0, gpu_id_step=1, dtype="auto",
                speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4, cuda_graph_bs=None,
                cuda_graph_max_bs=32, disable_cuda_graph=False)
    return SimpleNamespace(**{**base, **fields})


def test_the_command_measures_this_servers_gpus_sizes_and_dtype_only_when_no_table_exists(model, monkeypatch):
    monkeypatch.setattr(startup, "_capabilities", lambda gpus: [(12, 0)] * len(gpus))
    command = startup.tune_command(server_args(model, base_gpu_id=0, gpu_id_step=1), OverlaySettings())
    assert command[:3] == [sys.executable, "-m", "sglang_sm120.tune"]
    args = dict(zip(command[3::2], command[4::2], strict=False))
    assert args["--tp"] == "8" and args["--gpus"] == "0,1,2,3,4,5,6,7" and args["--hidden"] == "7168"
    assert args["--dtype"] == "bf16" and args["--max-rows"] == "128" and args["--draft-tokens"] == "4"
    assert command[-1] == "--if-missing" and "--quick" in command
    assert "--server-env" in command  # the tool measures under the NCCL_* settings the launcher set
    forced = startup.tune_command(server_args(model, tp_size=2, base_gpu_id=4, gpu_id_step=2),
                                  OverlaySettings(tune="force"))
    assert "--if-missing" not in forced and forced[forced.index("--gpus") + 1] == "4,6"


def test_an_eager_server_asks_for_no_captured_sizes_so_a_graph_servers_table_serves_it(model, monkeypatch):
    monkeypatch.setattr(startup, "_capabilities", lambda gpus: [(12, 0)] * len(gpus))
    graphs = startup.tune_command(server_args(model, cuda_graph_bs=[1, 2, 4], cuda_graph_max_bs=4), OverlaySettings())
    eager = startup.tune_command(server_args(model, cuda_graph_bs=[1, 2, 3, 4], cuda_graph_max_bs=4,
                                             disable_cuda_graph=True), OverlaySettings())
    assert graphs[graphs.index("--cuda-graph-bs") + 1] == "1,2,4" and "--cuda-graph-bs" not in eager
    assert eager[eager.index("--max-rows") + 1] == graphs[graphs.index("--max-rows") + 1]


def test_a_bound_given_by_the_user_is_the_bound_measured(model, monkeypatch):
    monkeypatch.setattr(startup, "_capabilities", lambda gpus: [(12, 0)] * len(gpus))
    command = startup.tune_command(server_args(model), OverlaySettings(max_bytes=16 * 7168 * 2))
    assert command[command.index("--max-rows") + 1] == "16"


@pytest.mark.parametrize("settings, fields, capabilities", [
    (OverlaySettings(mode="off"), {}, (12, 0)),
    (OverlaySettings(tune="off"), {}, (12, 0)),
    (OverlaySettings(), {"tp_size": 1}, (12, 0)),
    (OverlaySettings(), {"tp_size": 3}, (12, 0)),
    (OverlaySettings(), {"nnodes": 2}, (12, 0)),
    (OverlaySettings(mode="auto"), {}, (9, 0)),  # the gate would not enable: nothing to tune for
])
def test_no_tune_runs_where_no_rank_would_use_a_table(model, monkeypatch, settings, fields, capabilities):
    monkeypatch.setattr(startup, "_capabilities", lambda gpus: [capabilities] * len(gpus))
    assert startup.tune_command(server_args(model, **fields), settings) is None


def test_mode_on_tunes_whatever_the_gpus_are(model, monkeypatch):
    monkeypatch.setattr(startup, "_capabilities", lambda gpus: [(9, 0)] * len(gpus))
    assert startup.tune_command(server_args(model, tp_size=2), OverlaySettings(mode="on")) is not None


def test_the_launch_goes_on_after_the_tune_failed_or_raised(model, monkeypatch, caplog):
    calls = []
    wrapped = startup.wrap_set_envs_and_config(lambda sa: calls.append("sglang") or "done")
    monkeypatch.setattr(startup, "tune_command", lambda sa, settings: [sys.executable, "-c", "raise SystemExit(3)"])
    assert wrapped(server_args(model)) == "done" and calls == ["sglang"]
    assert "the tune at launch failed (exit code 3" in caplog.text
    monkeypatch.setattr(startup, "tune_command", lambda sa, settings: 1 / 0)
    assert wrapped(server_args(model)) == "done"
    assert "the tune at launch could not run" in caplog.text


def test_a_model_whose_hidden_size_cannot_be_read_skips_the_tune_and_the_launch_goes_on(tmp_path, monkeypatch,
                                                                                        caplog):
    monkeypatch.setattr(startup, "_capabilities", lambda gpus: [(12, 0)] * len(gpus))
    (tmp_path / "config.json").write_text("{}")
    wrapped = startup.wrap_set_envs_and_config(lambda sa: "done")
    assert wrapped(server_args(str(tmp_path))) == "done"
    assert "no tune at launch" in caplog.text and "names no hidden_size" in caplog.text


def test_the_tune_runs_after_sglangs_own_environment_is_set(model, monkeypatch):
    order = []
    monkeypatch.setattr(startup, "tune_before_ranks", lambda sa: order.append("tune"))
    startup.wrap_set_envs_and_config(lambda sa: order.append("sglang"))(server_args(model))
    assert order == ["sglang", "tune"]


def test_a_tune_past_its_bound_is_ended_with_its_process_group_and_the_launch_goes_on(model, monkeypatch, caplog,
                                                                                       tmp_path):
    """The tool ignores SIGTERM here (a stuck tool): SIGKILL follows; the shell it started in its process group goes
    too. The bound is the tool's own deadline plus a grace for its failure note."""
    monkeypatch.setenv("SGLANG_SM120_ALLREDUCE_TUNE_TIMEOUT_S", "0.2")
    monkeypatch.setattr(startup, "KILL_GRACE_S", 0.3)
    pid_file = tmp_path / "sleeper.pid"
    script = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); "
              "time.sleep(60)")
    monkeypatch.setattr(startup, "tune_command", lambda sa, settings: [sys.executable, "-c", script])
    start = time.monotonic()
    assert startup.tune_before_ranks(server_args(model)) == -1
    assert time.monotonic() - start < 15
    assert "the tune at launch failed (exit code -1" in caplog.text
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{sleeper}") and \
            open(f"/proc/{sleeper}/stat").read().split()[2] != "Z":
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{sleeper}") or open(f"/proc/{sleeper}/stat").read().split()[2] == "Z"
