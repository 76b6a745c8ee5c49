"""The parent side of a tune, with stand-in children (small Python scripts speaking the child's protocol): a good
run, a child killed by a candidate (found, excluded, retried), a stalled group, a child's own error."""

from __future__ import annotations

import sys

import pytest

from sglang_sm120.tuning import processes as launch
from sglang_sm120.tuning.child import MARKER
from sglang_sm120.tuning.tuner import TuneSpec

# argv: rank, spec path, behaviour. Each child begins two candidates and reports a table.
STAND_IN = r'''
import json, os, signal, sys, time
rank, spec_path, behaviour = int(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = json.load(open(spec_path))
def emit(**event):
    print(MARKER + json.dumps(event), flush=True)
print("some unrelated output", flush=True)
emit(event="setup", key={"world_size": 2, "gpus": "stand-in"})
if behaviour == "found":
    emit(event="found", path="/cache/routes_tp2_h7168_x.json")
    sys.exit(0)
excluded = {rule["candidate"] for rule in spec["exclude"]}
for cid, nbytes in (("nccl", 14336), ("sm120/ONESHOT/push/device", 28672)):
    if cid in excluded:
        continue
    emit(event="begin", dtype="bfloat16", kind="plain", rows=nbytes // 14336, bytes=nbytes, candidate=cid)
    if cid.startswith("sm120") and behaviour == "crash" and rank == 1:
        print("CUDA error: an illegal memory access was encountered", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if cid.startswith("sm120") and behaviour == "hang":
        time.sleep(60)
if behaviour == "error":
    emit(event="error", error="RuntimeError: NCCL could not start", trace="Traceback ...")
    sys.exit(1)
digest = "d-%d" % rank if behaviour == "disagree" else "d"
emit(event="done", table={"excluded": sorted(excluded)}, digest=digest, child_s=0.1)
'''.replace("MARKER", repr(MARKER))


def command(behaviour):
    return lambda rank, device, spec_path: [sys.executable, "-c", STAND_IN, str(rank), spec_path, behaviour]


def spec():
    return TuneSpec(hidden=7168, max_rows=2, dtypes=["bfloat16"], kinds=["plain"])


def run(behaviour, **kw):
    return launch.run_children([(0, 0), (1, 0)], 2, spec(), timeout_s=kw.get("timeout_s", 60),
                               stall_s=kw.get("stall_s", 30), command=command(behaviour), env=None)


def test_children_that_agree_give_their_table():
    events = []
    outcomes = launch.run_children([(0, 0), (1, 0)], 2, spec(), timeout_s=60, stall_s=30, command=command("ok"),
                                   on_event=lambda rank, event: events.append((rank, event["event"])))
    attempt = launch.summarize(outcomes)
    assert attempt.error is None and attempt.table == {"excluded": []} and attempt.digest == "d"
    assert (1, "done") in events and sum(1 for _, e in events if e == "begin") == 4
    assert outcomes[0].tail == ["some unrelated output"]


def test_children_that_disagree_give_nothing():
    attempt = launch.summarize(run("disagree"))
    assert attempt.table is None and attempt.error == "the ranks reported different tables"


def test_a_child_killed_by_a_candidate_names_it():
    attempt = launch.summarize(run("crash"))
    assert attempt.table is None
    assert attempt.culprit["candidate"] == "sm120/ONESHOT/push/device" and attempt.culprit["from_bytes"] == 28672
    reason = attempt.culprit["reason"]
    assert reason.startswith("rank 1 died (exit code -9): ") and reason.endswith(" while running it")
    assert "CUDA error: an illegal memory access was encountered" in reason  # the child's last words


def test_the_tool_retries_without_the_candidate_that_killed_a_rank():
    retried = []
    s = spec()
    attempt = launch.tune_with_retries(2, [0, 0], s, retries=2, timeout_s=60, stall_s=30, command=command("crash"),
                                       on_retry=retried.append)
    assert attempt.error is None and attempt.table == {"excluded": ["sm120/ONESHOT/push/device"]}
    assert len(retried) == 1 and s.exclude[0]["candidate"] == "sm120/ONESHOT/push/device"


def test_a_stalled_group_is_killed_and_the_running_candidate_blamed():
    outcomes = run("hang", stall_s=1.0)
    attempt = launch.summarize(outcomes)
    assert all(o.killed == "no progress for 1 s" for o in outcomes)
    assert attempt.culprit["candidate"] == "sm120/ONESHOT/push/device"
    assert attempt.culprit["reason"] == "no progress for 1 s while running it"


def test_a_childs_own_error_is_reported_and_not_retried():
    s = spec()
    attempt = launch.tune_with_retries(2, [0, 0], s, retries=3, timeout_s=60, stall_s=30, command=command("error"))
    assert attempt.culprit is None and s.exclude == []
    assert attempt.error == "rank 0: RuntimeError: NCCL could not start; rank 1: RuntimeError: NCCL could not start"


def test_ranks_that_find_a_table_of_their_key_stop_without_measuring():
    attempt = launch.tune_with_retries(2, [0, 0], spec(), retries=2, timeout_s=60, stall_s=30, command=command("found"))
    assert attempt.found == "/cache/routes_tp2_h7168_x.json" and attempt.table is None and attempt.error is None
    assert all(o.begins == 0 for o in attempt.outcomes)


def test_the_child_environment_puts_both_packages_first():
    env = launch.child_env({"PYTHONPATH": "/elsewhere"})
    parts = env["PYTHONPATH"].split(":")
    assert parts[-1] == "/elsewhere" and len(parts) >= 2


def test_the_real_child_reports_its_own_failure_as_an_error_event():
    # On a machine without a GPU the child fails at its first CUDA call; the parent must get that as the
    # child's error (not as a crash blamed on a candidate).
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA GPU")
    outcome = launch.run_children([(0, 0)], 1, spec(), timeout_s=120, stall_s=120)[0]
    assert outcome.returncode == 1 and outcome.error and outcome.last_begin is None, outcome
    assert launch.summarize([outcome]).culprit is None
