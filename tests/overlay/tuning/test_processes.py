"""The parent side of a tune, with stand-in children (small Python scripts speaking the child's protocol): a good
run, a child killed by a candidate (found, excluded, retried, recorded as the attempt ends), a stalled group, a
deadline, a child's own error; and a real child's death with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

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
marker = os.path.join(os.path.dirname(spec_path), "sm120-test-retried-%d-%d" % (os.getppid(), rank))
if behaviour == "retry" and not os.path.exists(marker):
    open(marker, "w").close()
    emit(event="error", retry=True, error="the cluster check broke this process's CUDA context")
    sys.exit(3)
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
    if behaviour == "slow":
        time.sleep(0.5)
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
    return launch.run_children([(0, 0), (1, 0)], 2, spec(), deadline=time.monotonic() + kw.get("timeout_s", 60),
                               stall_s=kw.get("stall_s", 30), command=command(behaviour), env=None)


def with_retries(behaviour, s=None, **kw):
    return launch.tune_with_retries(2, [0, 0], s or spec(), retries=kw.pop("retries", 2),
                                    deadline=time.monotonic() + kw.pop("timeout_s", 60), stall_s=30,
                                    command=command(behaviour), **kw)


def test_children_that_agree_give_their_table():
    events = []
    outcomes = launch.run_children([(0, 0), (1, 0)], 2, spec(), deadline=time.monotonic() + 60, stall_s=30,
                                   command=command("ok"),
                                   on_event=lambda rank, event: events.append((rank, event["event"])))
    attempt = launch.summarize(outcomes)
    assert attempt.error is None and attempt.table == {"excluded": []} and attempt.digest == "d"
    assert (1, "done") in events and sum(1 for _, e in events if e == "begin") == 4
    assert outcomes[0].tail == ["some unrelated output"]
    assert 0 <= outcomes[0].phases["setup"] <= outcomes[0].phases["done"]


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


def test_the_tool_retries_without_the_candidate_that_killed_a_rank_and_reports_each_attempt_as_it_ends():
    ended = []
    s = spec()
    attempt = with_retries("crash", s, on_attempt=ended.append)
    assert attempt.error is None and attempt.table == {"excluded": ["sm120/ONESHOT/push/device"]}
    assert s.exclude[0]["candidate"] == "sm120/ONESHOT/push/device"
    assert [a.culprit["candidate"] if a.culprit else None for a in ended] == ["sm120/ONESHOT/push/device", None]


def test_a_tune_cut_by_its_deadline_blames_no_candidate_and_is_not_retried():
    ended = []
    attempt = with_retries("slow", timeout_s=0.8, on_attempt=ended.append)
    assert attempt.table is None and attempt.culprit is None and len(ended) == 1
    assert attempt.error.startswith("the tune did not finish within"), attempt.error


def test_an_error_that_asks_for_it_starts_a_new_attempt_without_blame():
    s = spec()
    try:
        attempt = with_retries("retry", s)
    finally:
        for rank in (0, 1):
            marker = os.path.join(tempfile.gettempdir(), f"sm120-test-retried-{os.getpid()}-{rank}")
            if os.path.exists(marker):
                os.unlink(marker)
    assert attempt.error is None and attempt.table == {"excluded": []} and s.exclude == []


def test_a_stalled_group_is_killed_and_the_running_candidate_blamed():
    outcomes = run("hang", stall_s=1.0)
    attempt = launch.summarize(outcomes)
    assert all(o.killed == "no progress for 1 s" for o in outcomes)
    assert attempt.culprit["candidate"] == "sm120/ONESHOT/push/device"
    assert attempt.culprit["reason"] == "no progress for 1 s while running it"


def test_a_childs_own_error_is_reported_and_not_retried():
    s = spec()
    attempt = with_retries("error", s, retries=3)
    assert attempt.culprit is None and s.exclude == []
    assert attempt.error == "rank 0: RuntimeError: NCCL could not start; rank 1: RuntimeError: NCCL could not start"


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
    outcome = launch.run_children([(0, 0)], 1, spec(), deadline=time.monotonic() + 120, stall_s=120)[0]
    assert outcome.returncode == 1 and outcome.error and outcome.last_begin is None, outcome
    assert launch.summarize([outcome]).culprit is None


PARENT = r'''
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, sys, time; sys.path[:0] = sys.argv[1:]; "
                          "from sglang_sm120.tuning.child import die_with_parent; die_with_parent(os.getppid()); "
                          "print('armed', flush=True); time.sleep(120)", *sys.argv[1:]],
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(120)
'''


def test_a_rank_process_dies_with_its_parent_however_the_parent_ends():
    """A launcher's SIGKILL of the tool must not leave its ranks running (in sessions of their own, with their CUDA
    contexts) beside the server's ranks."""
    paths = [p for p in sys.path if p]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, *paths], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child_pid}/stat") as stat:
            if stat.read().split()[2] == "Z":  # ended, not yet reaped by init
                return
        time.sleep(0.05)
    os.kill(child_pid, signal.SIGKILL)
    pytest.fail(f"the rank process {child_pid} outlived its parent by 5 s")
