"""`python -m sglang_sm120.tune` on CPU: its arguments, the model's hidden size, the ranks it plans, and what it
does with the group's outcome (the children are replaced by a canned outcome)."""

from __future__ import annotations

import json

import pytest

from sglang_sm120 import tune
from sglang_sm120.core import config
from sglang_sm120.routing import cache
from sglang_sm120.tuning import processes as launch

from .routing.test_table import _table


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
    (["--hidden", "7168", "--tp", "3"], "--tp 3: the kernels run 2, 4 or 8 ranks"),
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


def _canned(monkeypatch, attempt):
    monkeypatch.setattr(tune, "plan_ranks", lambda tp, gpus, share, chosen: (2, [0, 1]))
    seen = {}

    def tune_with_retries(world, devices, spec, **kw):
        seen.update(world=world, devices=devices, spec=spec)
        return attempt

    monkeypatch.setattr(launch, "tune_with_retries", tune_with_retries)
    return seen


def test_a_successful_tune_is_saved_where_servers_look_and_printed(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _table([10, 10], [5, 5])
    seen = _canned(monkeypatch, launch.Attempt(table.to_dict(), table.digest(), None, None, []))
    out_file = tmp_path / "copy.json"
    assert tune.main(["--hidden", "7168", "--max-batch", "2", "--draft-tokens", "1", "--quick", "--out",
                      str(out_file)]) == 0
    assert seen["spec"].max_rows == 2 and seen["spec"].quick and seen["world"] == 2
    path = cache.table_path(table.key, 7168)
    saved = cache.load_file(path)
    assert saved.ok and saved.table.durations["total"] >= 0 and out_file.exists()
    out = capsys.readouterr().out
    assert f"written to {path}" in out and "ONESHOT/push/device" in out


def test_the_transports_nccl_logged_in_the_tune_go_into_the_table(monkeypatch, tmp_path):
    """The children get NCCL's INFO channel lines sent to a file each (the stand-in writes what NCCL 2.28 would);
    the table's notes name the kind per pair. A caller's own NCCL_DEBUG is left alone."""
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    table = _table([10, 10], [5, 5])
    seen_env = {}

    def tune_with_retries(world, devices, spec, *, env, **kw):
        seen_env.update(env)
        with open(env["NCCL_DEBUG_FILE"].replace("%p", "4242"), "w") as log:
            log.write("box:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
                      "box:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
                      "box:1:1 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct\n")
        return launch.Attempt(table.to_dict(), table.digest(), None, None, [])

    monkeypatch.setattr(tune, "plan_ranks", lambda tp, gpus, share, chosen: (2, [0, 1]))
    monkeypatch.setattr(launch, "tune_with_retries", tune_with_retries)
    assert tune.main(["--hidden", "7168", "--max-batch", "2", "--draft-tokens", "1", "--quick"]) == 0
    assert seen_env["NCCL_DEBUG"] == "INFO" and "P2P" in seen_env["NCCL_DEBUG_SUBSYS"]
    saved = cache.load_file(cache.table_path(table.key, 7168)).table
    assert "NCCL 2.28.9+cuda13.0 connected SHM for 0->1 1->0" in saved.notes, saved.notes


def test_a_failed_tune_says_why_and_writes_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    outcome = launch.ChildOutcome(1, returncode=-9, tail=["CUDA error: an illegal memory access"])
    _canned(monkeypatch, launch.Attempt(None, None, "rank 1 died (exit code -9)", None, [outcome]))
    assert tune.main(["--hidden", "7168"]) == 1
    err = capsys.readouterr().err
    assert "tune failed: rank 1 died (exit code -9)" in err and "illegal memory access" in err
    assert list(tmp_path.iterdir()) == []


def test_a_candidate_that_killed_a_rank_is_blamed_in_the_cache_for_the_next_tunes(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    table = _table([10, 10], [5, 5])
    culprit = {"dtype": "bfloat16", "kind": "fused", "candidate": "sm120/ONESHOT/pull/device", "from_bytes": 14336,
               "reason": "rank 1 died (exit code -9) while running it"}
    outcome = launch.ChildOutcome(1, returncode=-9, key=table.key)
    _canned(monkeypatch, launch.Attempt(None, None, "rank 1 died (exit code -9)", culprit, [outcome]))
    assert tune.main(["--hidden", "7168"]) == 1
    assert [b["candidate"] for b in cache.blames(table.key)] == ["sm120/ONESHOT/pull/device"]
    assert "blamed for a crash or hang, never tuned or routed again on this box: sm120/ONESHOT/pull/device" in \
        capsys.readouterr().out
    # a later successful tune that excluded one more keeps both
    seen = _canned(monkeypatch, launch.Attempt(table.to_dict(), table.digest(), None, None, []))
    monkeypatch.setattr(launch, "tune_with_retries", lambda world, devices, spec, **kw: (
        spec.exclude.append(dict(culprit, candidate="sm120/TWOSHOT/push/device")), seen.update(spec=spec),
        launch.Attempt(table.to_dict(), table.digest(), None, None, []))[-1])
    assert tune.main(["--hidden", "7168"]) == 0
    assert sorted(b["candidate"] for b in cache.blames(table.key)) == [
        "sm120/ONESHOT/pull/device", "sm120/TWOSHOT/push/device"]


def test_the_chosen_gpus_are_the_ranks_devices():
    assert tune.plan_ranks(None, 8, False, [4, 5, 6, 7]) == (4, [4, 5, 6, 7])
    assert tune.plan_ranks(2, 1, True, [0, 0]) == (2, [0, 0])
    with pytest.raises(SystemExit, match="--gpus"):
        tune.plan_ranks(2, 2, False, [0, 2])


def test_a_tune_that_finds_a_table_of_this_box_measures_nothing_and_says_where(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    seen = _canned(monkeypatch, launch.Attempt(None, None, None, None, [], found="/x/routes_tp2_h7168_ab.json"))
    assert tune.main(["--hidden", "7168", "--if-missing", "--quick"]) == 0
    assert seen["spec"].if_missing
    assert "a routing table of this box exists: /x/routes_tp2_h7168_ab.json" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_the_one_process_measurer_refuses_without_an_injected_nccl_time():
    from benchmarks.harness.local_tune import LocalGroupMeasurer
    from sglang_sm120.tuning.tuner import TuneSpec

    with pytest.raises(ValueError, match="debug_nccl_us"):
        LocalGroupMeasurer(world=2, device="cpu", spec=TuneSpec.make(1024, 4, quick=True))
