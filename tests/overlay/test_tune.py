"""`python -m sglang_sm120.tune` on CPU: its arguments, the model's hidden size, the ranks it plans, and what it
does with the group's outcome (the children are replaced by a canned outcome)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from sglang_sm120 import tune
from sglang_sm120.core import config
from sglang_sm120.routing import cache
from sglang_sm120.tuning import processes as launch

from .routing.test_table import _table


@pytest.fixture(autouse=True)
def own_environment(monkeypatch):
    """The tool, run by hand, sets the NCCL_* variables a server would (in its own process): here, in a copy."""
    monkeypatch.setattr(os, "environ", os.environ.copy())


def test_the_hidden_size_is_read_at_the_top_or_in_the_text_model():
    assert config.hidden_from_config({"hidden_size": 4096}) == 4096
    multimodal = {"text_config": {"hidden_size": 7168}, "vision_config": {"hidden_size": 1}}
    assert config.hidden_from_config(multimodal) == 7168
    assert config.hidden_from_config({"vocab_size": 3}) is None


def test_a_local_model_folder_gives_its_hidden_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168}}))
    assert config.hidden_from_model(str(tmp_path)) == 7168
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="names no hidden_size; pass --hidden"):
        config.hidden_from_model(str(tmp_path))


@pytest.mark.parametrize("argv, message", [
    (["--hidden", "7168", "--tp", "3"], "--tp 3: the kernels run 2, 4, 8 ranks"),
    (["--hidden", "7168", "--dtype", "fp32"], "unknown dtype 'fp32'"),
    (["--hidden", "7168", "--kinds", "plain,mixed"], "a comma list of plain, fused"),
    (["--hidden", "7168", "--max-batch", "0"], "--max-batch must be >= 1"),
    (["--tp", "2"], "one of the arguments --model-path --hidden is required"),
    (["--hidden", "7168", "--model-path", "x"], "not allowed with argument"),
    (["--hidden", "7168", "--gpus", "0,x"], "--gpus / --cuda-graph-bs"),
    (["--hidden", "7168", "--cuda-graph-bs", "1,0"], "batch sizes and draft tokens must be >= 1"),
])
def test_bad_arguments_end_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(argv)
    assert message in capsys.readouterr().err


def test_arguments_become_a_spec():
    args = tune.parse_args(["--hidden", "7168", "--dtype", "fp16,bf16,fp16", "--kinds", "fused", "--quick"])
    assert args.dtypes == ["float16", "bfloat16"] and args.kinds_list == ["fused"] and args.quick
    assert args.graph_rows == []


def test_captured_batch_sizes_become_the_graph_rows_measured():
    args = tune.parse_args(["--hidden", "7168", "--cuda-graph-bs", "1,2,4,8,12", "--draft-tokens", "4"])
    assert args.graph_rows == [1, 2, 4, 8, 12, 16, 32, 48]


@pytest.mark.parametrize("tp, gpus, share, expected", [
    (None, 8, False, (8, list(range(8)))),
    (None, 6, False, (4, [0, 1, 2, 3])),
    (2, 8, False, (2, [0, 1])),
    (None, 1, True, (2, [0, 0])),
    (8, 1, True, (8, [0] * 8)),
])
def test_ranks_go_one_per_gpu_or_share_when_asked(tp, gpus, share, expected):
    assert tune.plan_ranks(tp, gpus, share) == expected


@pytest.mark.parametrize("tp, gpus, message", [(None, 0, "no CUDA GPU"), (None, 1, "--share-gpu"), (4, 2, "needs 4")])
def test_too_few_gpus_are_named(tp, gpus, message):
    with pytest.raises(SystemExit, match=message):
        tune.plan_ranks(tp, gpus, False)


ONE_SIZE_PLAIN = ["--max-batch", "2", "--draft-tokens", "1", "--kinds", "plain", "--dtype", "bf16"]
BOX = {"world_size": 2, "gpus": [{"uuid": "GPU-0"}, {"uuid": "GPU-1"}]}


def _canned(monkeypatch, attempt, planned="seen-1"):
    """The tool with its GPU steps replaced: two ranks on cuda:0,1, what it sees digested as `planned`, and the
    children's canned outcome (every attempt reported as it ends)."""
    monkeypatch.setattr(tune, "plan_ranks", lambda tp, gpus, share, chosen: (2, [0, 1]))
    monkeypatch.setattr(launch, "planned", lambda devices, hostmem: (planned, BOX))
    seen = {"runs": 0}

    def tune_with_retries(world, devices, spec, *, on_attempt, **kw):
        seen.update(world=world, devices=devices, spec=spec, kw=kw, runs=seen["runs"] + 1)
        on_attempt(attempt)
        return attempt

    monkeypatch.setattr(launch, "tune_with_retries", tune_with_retries)
    return seen


def _box_table():
    """A plain bf16 table of BOX's GPUs, rows 1 and 2, tuned under what the tool sees as "seen-1"."""
    table = _table([10, 10], [5, 5])
    table.key.update(BOX)
    table.workload["rows"] = [1, 2]
    table.planned = "seen-1"
    return table


def _good(table):
    return launch.Attempt(table.to_dict(), table.digest(), None, None, [])


def test_a_successful_tune_is_saved_where_servers_look_and_printed(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _table([10, 10], [5, 5])
    seen = _canned(monkeypatch, _good(table))
    out_file = tmp_path / "copy.json"
    assert tune.main(["--hidden", "7168", "--max-batch", "2", "--draft-tokens", "1", "--quick", "--out",
                      str(out_file)]) == 0
    assert seen["spec"].max_rows == 2 and seen["spec"].quick and seen["world"] == 2
    path = cache.table_path(table.key, 7168)
    saved = cache.load_file(path)
    assert saved.ok and saved.table.durations["total"] >= 0 and out_file.exists()
    assert saved.table.planned == "seen-1"
    out = capsys.readouterr().out
    assert f"written to {path}" in out and "ONESHOT/push/device" in out


def test_the_whole_run_has_one_deadline_and_a_stall_bound_within_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    seen = _canned(monkeypatch, _good(_table([10, 10], [5, 5])))
    before = time.monotonic()
    assert tune.main(["--hidden", "7168", "--timeout", "30", "--stall", "120"]) == 0
    assert before < seen["kw"]["deadline"] <= time.monotonic() + 30 and seen["kw"]["stall_s"] == 30


def test_the_transports_nccl_logged_in_the_tune_go_into_the_table(monkeypatch, tmp_path):
    """The children get NCCL's INFO channel lines sent to a file each (the stand-in writes what NCCL 2.28 would);
    the table's notes name the kind per pair. A caller's own NCCL_DEBUG is left alone."""
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    table = _table([10, 10], [5, 5])
    seen_env = {}
    _canned(monkeypatch, _good(table))

    def tune_with_retries(world, devices, spec, *, env, **kw):
        seen_env.update(env)
        with open(env["NCCL_DEBUG_FILE"].replace("%p", "4242"), "w") as log:
            log.write("box:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
                      "box:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
                      "box:1:1 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct\n")
        return _good(table)

    monkeypatch.setattr(launch, "tune_with_retries", tune_with_retries)
    assert tune.main(["--hidden", "7168", "--max-batch", "2", "--draft-tokens", "1", "--quick"]) == 0
    assert seen_env["NCCL_DEBUG"] == "INFO" and "P2P" in seen_env["NCCL_DEBUG_SUBSYS"]
    saved = cache.load_file(cache.table_path(table.key, 7168)).table
    assert "NCCL 2.28.9+cuda13.0 connected SHM for 0->1 1->0" in saved.notes, saved.notes


def test_a_failed_tune_says_why_writes_no_table_and_leaves_a_note_a_launch_does_not_retry_past(
        monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    outcome = launch.ChildOutcome(1, returncode=-9, tail=["CUDA error: an illegal memory access"])
    seen = _canned(monkeypatch, launch.Attempt(None, None, "rank 1 died (exit code -9)", None, [outcome]))
    assert tune.main(["--hidden", "7168", "--if-missing"]) == 1
    err = capsys.readouterr().err
    assert "tune failed: rank 1 died (exit code -9)" in err and "illegal memory access" in err
    assert not os.path.exists(cache.table_path(BOX, 7168))
    note = cache.failure(BOX, 7168, planned="seen-1")
    assert note and note["reason"] == "rank 1 died (exit code -9)" and "--sm120-allreduce-tune force" in \
        note["command"]
    # the next launch does not tune again (no GPU process) and says why and how to retry
    assert tune.main(["--hidden", "7168", "--if-missing"]) == 0 and seen["runs"] == 1
    out = capsys.readouterr().out
    assert "not tuning again: the last tune of these GPUs failed at" in out and "retry with" in out
    # anything seen changed (another digest): a launch tunes again
    seen = _canned(monkeypatch, _good(_table([10, 10], [5, 5])), planned="seen-2")
    assert tune.main(["--hidden", "7168", "--if-missing"]) == 0 and seen["runs"] == 1
    assert cache.failure(BOX, 7168) is None  # a success clears it


def test_force_tunes_past_a_failure_note(monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    cache.record_failure(BOX, 7168, "rank 0 died", "python -m sglang_sm120.tune ...", planned="seen-1")
    seen = _canned(monkeypatch, _good(_table([10, 10], [5, 5])))
    assert tune.main(["--hidden", "7168"]) == 0 and seen["runs"] == 1
    assert cache.failure(BOX, 7168) is None


def test_a_launch_finds_a_table_of_what_it_sees_without_starting_a_gpu_process(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _box_table()
    cache.save(table)
    seen = _canned(monkeypatch, _good(table))
    assert tune.main(["--hidden", "7168", *ONE_SIZE_PLAIN, "--if-missing"]) == 0
    assert seen["runs"] == 0
    assert f"a routing table of this box exists: {cache.table_path(BOX, 7168)}" in capsys.readouterr().out
    # a captured size it did not measure, or a change of what the tool sees: measured again, the reason said
    assert tune.main(["--hidden", "7168", "--max-batch", "2", "--draft-tokens", "1", "--cuda-graph-bs", "3",
                      "--kinds", "plain", "--dtype", "bf16", "--if-missing"]) == 0 and seen["runs"] == 1
    assert "it did not measure rows [3]; measuring again" in capsys.readouterr().out
    seen = _canned(monkeypatch, _good(table), planned="seen-2")
    assert tune.main(["--hidden", "7168", *ONE_SIZE_PLAIN, "--if-missing"]) == 0
    assert seen["runs"] == 1
    assert "tuned under other facts of this box" in capsys.readouterr().out


def test_a_table_tuned_under_other_facts_names_the_parts_that_changed(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _box_table()
    table.planned = "facts=a1 nccl=e1 p2p=b1 plan=c1 verdicts=d1"
    cache.save(table)
    seen = _canned(monkeypatch, _good(table), planned="facts=a1 nccl=e2 p2p=b1 plan=c1 verdicts=d2")
    assert tune.main(["--hidden", "7168", *ONE_SIZE_PLAIN, "--if-missing"]) == 0 and seen["runs"] == 1
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("not using"))
    assert line.startswith(f"not using the routing table at {cache.table_path(BOX, 7168)}: it was tuned under "
                           "other facts of this box (the NCCL_* settings")
    assert line.endswith("the cluster-check verdicts); measuring again") and "workspace" not in line, line


def test_the_table_holds_what_the_tool_sees_after_its_ranks_cached_their_cluster_verdicts(monkeypatch, tmp_path,
                                                                                            capsys):
    # the first launch sees no verdict, its ranks cache one: the next launch must find the table, not tune again
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _box_table()
    seen = _canned(monkeypatch, _good(table))
    digests = iter(["before the checks", "after the checks"])
    monkeypatch.setattr(launch, "planned", lambda devices, hostmem: (next(digests, "after the checks"), BOX))
    assert tune.main(["--hidden", "7168", *ONE_SIZE_PLAIN, "--if-missing"]) == 0 and seen["runs"] == 1
    assert cache.load_file(cache.table_path(BOX, 7168)).table.planned == "after the checks"
    assert tune.main(["--hidden", "7168", *ONE_SIZE_PLAIN, "--if-missing"]) == 0 and seen["runs"] == 1
    assert "a routing table of this box exists" in capsys.readouterr().out


def test_a_second_launch_waits_for_the_first_ones_tune_and_uses_its_table(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _box_table()
    seen = _canned(monkeypatch, _good(table))
    with cache.tune_lock(BOX, wait_s=0) as held:
        assert held
        writer = threading.Timer(0.5, lambda: cache.save(table))  # the first launch's tune ends meanwhile
        writer.start()
        result = {}

        def second():
            result["code"] = tune.main(["--hidden", "7168", "--max-batch", "2", "--draft-tokens", "1", "--kinds",
                                        "plain", "--dtype", "bf16", "--if-missing", "--timeout", "20"])

        launch_thread = threading.Thread(target=second)
        launch_thread.start()
        time.sleep(1.0)
        assert launch_thread.is_alive()  # waiting for the lock
    launch_thread.join(timeout=10)
    assert result["code"] == 0 and seen["runs"] == 0
    assert "written by another launch's tune" in capsys.readouterr().out


def test_a_second_launch_goes_on_without_a_table_when_the_first_holds_the_lock_past_its_budget(monkeypatch, tmp_path,
                                                                                                capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    seen = _canned(monkeypatch, _good(_table([10, 10], [5, 5])))
    with cache.tune_lock(BOX, wait_s=0) as held:
        assert held
        assert tune.main(["--hidden", "7168", "--if-missing", "--timeout", "1"]) == 1
    assert seen["runs"] == 0 and "held" in capsys.readouterr().err


def test_an_unwritable_cache_folder_ends_the_tool_before_any_gpu_work(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(blocked / "cache"))
    seen = _canned(monkeypatch, _good(_table([10, 10], [5, 5])))
    with pytest.raises(SystemExit, match="SGLANG_SM120_CACHE=.*folder"):
        tune.main(["--hidden", "7168"])
    assert seen["runs"] == 0


def test_a_candidate_that_killed_a_rank_is_blamed_in_the_cache_as_its_attempt_ends(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _table([10, 10], [5, 5])
    culprit = {"dtype": "bfloat16", "kind": "fused", "candidate": "sm120/ONESHOT/pull/device", "from_bytes": 14336,
               "reason": "rank 1 died (exit code -9) while running it"}
    outcome = launch.ChildOutcome(1, returncode=-9, key=table.key)
    _canned(monkeypatch, launch.Attempt(None, None, "rank 1 died (exit code -9)", culprit, [outcome]))
    assert tune.main(["--hidden", "7168"]) == 1
    assert [b["candidate"] for b in cache.blames(table.key)] == ["sm120/ONESHOT/pull/device"]
    assert "is blamed from 14336 B on and never tuned or routed again on this box" in capsys.readouterr().out


def test_the_chosen_gpus_are_the_ranks_devices():
    assert tune.plan_ranks(None, 8, False, [4, 5, 6, 7]) == (4, [4, 5, 6, 7])
    assert tune.plan_ranks(2, 1, True, [0, 0]) == (2, [0, 0])
    with pytest.raises(SystemExit, match="--gpus"):
        tune.plan_ranks(2, 2, False, [0, 2])


def test_the_start_up_phases_of_the_slowest_rank_become_durations():
    fast = launch.ChildOutcome(0, phases={"start": 0.2, "cuda": 1.0, "clusters": 1.1, "group": 1.5, "workspace": 2.0})
    slow = launch.ChildOutcome(1, phases={"start": 0.3, "cuda": 1.4, "clusters": 1.5, "group": 1.6, "workspace": 2.5})
    assert tune.phase_durations([fast, slow]) == {"start": 0.3, "torch and CUDA": 1.1, "cluster check": 0.1,
                                                  "process group": 0.1, "workspace and probe": 0.9}


def test_the_one_process_measurer_refuses_without_an_injected_nccl_time():
    from benchmarks.harness.local_tune import LocalGroupMeasurer
    from sglang_sm120.tuning.tuner import TuneSpec

    with pytest.raises(ValueError, match="debug_nccl_us"):
        LocalGroupMeasurer(world=2, device="cpu", spec=TuneSpec.make(1024, 4, quick=True))


@pytest.mark.parametrize("release, server_nccl", [
    ("0.5.23", {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", "NCCL_GRAPH_REGISTER": "0"}),
    ("0.5.13.post1", {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}),
])
def test_run_by_hand_the_tool_measures_nccl_as_a_server_runs_it(monkeypatch, tmp_path, capsys, release, server_nccl):
    """An SGLang launcher sets NCCL_* variables before its ranks start, and a table is keyed by every one: a table
    tuned by hand without them would never be the server's. One the user set stays; the launcher's tool
    (--server-env) sets nothing."""
    from sglang_sm120 import seams
    from sglang_sm120.seams import base

    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    monkeypatch.setattr(seams, "sglang_version", lambda: release)
    monkeypatch.setattr(base, "check_resolvable", lambda targets: None)  # the other release's names
    for name in server_nccl:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    seen_env = {}

    def planned(devices, hostmem):
        seen_env.update({k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
        return "seen-1", BOX

    _canned(monkeypatch, _good(_table([10, 10], [5, 5])))
    monkeypatch.setattr(launch, "planned", planned)
    assert tune.main(["--hidden", "7168", *ONE_SIZE_PLAIN]) == 0
    assert seen_env == {**server_nccl, "NCCL_NVLS_ENABLE": "1"}
    expected = " ".join(f"{k}=0" for k in server_nccl if k != "NCCL_NVLS_ENABLE")
    assert f"NCCL measured as an SGLang {release} server runs it: {expected} (its launcher" in capsys.readouterr().out
    for name in server_nccl:
        monkeypatch.delenv(name, raising=False)
    seen_env.clear()
    assert tune.main(["--hidden", "7168", *ONE_SIZE_PLAIN, "--server-env"]) == 0
    assert seen_env == {} and "NCCL measured as" not in capsys.readouterr().out
