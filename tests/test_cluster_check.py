"""The cluster-launch check (sgl_kernel_sm120/cluster_check.py) on CPU: switches, the cache, and how a child's
outcome becomes a verdict. The child itself runs on the GPU (tests/gpu/test_ipc_allreduce.py)."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from sgl_kernel_sm120 import cluster_check
from sgl_kernel_sm120.cluster_check import ClusterVerdict
from sgl_kernel_sm120.settings import KernelSettings


@pytest.fixture
def children(monkeypatch):
    """Replaces the child process: records each run and answers with the verdict set in `answer`."""
    runs = []
    answer = {"verdict": ClusterVerdict(True, "clusters of 2, 4, 8 CTAs ran", "checked")}

    def fake(device_index, debug):
        runs.append((device_index, debug))
        return answer["verdict"]

    monkeypatch.setattr(cluster_check, "_run_child", fake)
    return runs, answer


def test_switched_off_runs_no_check(tmp_path, children):
    runs, _ = children
    verdict = cluster_check.verdict_for(0, "GPU-a", "/lib.so", KernelSettings(fused_clusters=False,
                                                                              cache_dir=str(tmp_path)))
    assert not verdict.ok and verdict.source == "off" and "SGL_SM120_FUSED_CLUSTERS=off" in verdict.reason
    assert runs == []


def test_verdict_is_cached_per_gpu_and_library(tmp_path, children):
    runs, answer = children
    library = tmp_path / "lib.so"
    library.write_bytes(b"x")
    env = KernelSettings(cache_dir=str(tmp_path / "cache"))
    first = cluster_check.verdict_for(0, "GPU-a", str(library), env)
    again = cluster_check.verdict_for(0, "GPU-a", str(library), env)
    assert first.ok and first.source == "checked" and again.ok and again.source == "cache"
    assert len(runs) == 1
    answer["verdict"] = ClusterVerdict(False, "illegal instruction", "checked")
    other_gpu = cluster_check.verdict_for(1, "GPU-b", str(library), env)
    assert not other_gpu.ok and len(runs) == 2  # another GPU is checked on its own
    library.write_bytes(b"rebuilt")  # another build of the library: checked again
    assert not cluster_check.verdict_for(0, "GPU-a", str(library), env).ok and len(runs) == 3
    table = json.loads((tmp_path / "cache" / cluster_check.CACHE_FILE).read_text())
    assert len(table) == 3 and all({"ok", "reason", "when"} <= entry.keys() for entry in table.values())


def test_debug_switch_bypasses_the_cache(tmp_path, children):
    runs, answer = children
    env = KernelSettings(cache_dir=str(tmp_path), debug_cluster_check="trap")
    answer["verdict"] = ClusterVerdict(False, "the cluster check failed (exit code 1): launch failure", "debug")
    assert not cluster_check.verdict_for(0, "GPU-a", "/lib.so", env).ok
    assert runs == [(0, "trap")]
    assert not (tmp_path / cluster_check.CACHE_FILE).exists()


class _Done:
    def __init__(self, returncode, stdout="", stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.mark.parametrize(
    "outcome, ok, says",
    [
        (_Done(0, 'noise\n{"ok": true, "reason": "clusters of 2, 4, 8 CTAs ran"}\n'), True, "clusters of 2, 4, 8"),
        (_Done(0, '{"ok": false, "reason": "other bits than one CTA per row"}\n'), False, "other bits"),
        (_Done(1, "", "Traceback ...\nRuntimeError: CUDA error: an illegal instruction was encountered\n"), False,
         "exit code 1): Traceback ... RuntimeError: CUDA error: an illegal instruction"),
        (_Done(-6, "", ""), False, "exit code -6"),
    ],
)
def test_a_child_outcome_becomes_a_verdict(monkeypatch, outcome, ok, says):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: outcome)
    verdict = cluster_check._run_child(0, "")
    assert verdict.ok is ok and says in verdict.reason, verdict


def test_a_child_that_hangs_is_no_clusters(monkeypatch):
    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))

    monkeypatch.setattr(subprocess, "run", hang)
    verdict = cluster_check._run_child(0, "")
    assert not verdict.ok and "did not finish" in verdict.reason


def test_a_check_that_timed_out_is_not_cached_and_runs_again(tmp_path, children):
    runs, answer = children
    env = KernelSettings(cache_dir=str(tmp_path))
    answer["verdict"] = ClusterVerdict(False, "the cluster check did not finish within 120 s", "checked",
                                       transient=True)
    assert not cluster_check.verdict_for(0, "GPU-a", "/lib.so", env).ok
    assert not (tmp_path / cluster_check.CACHE_FILE).exists()
    answer["verdict"] = ClusterVerdict(True, "clusters of 2, 4, 8 CTAs ran", "checked")
    again = cluster_check.verdict_for(0, "GPU-a", "/lib.so", env)
    assert again.ok and again.source == "checked" and len(runs) == 2


def test_a_child_that_hangs_or_cannot_start_gives_a_transient_verdict(monkeypatch):
    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))

    monkeypatch.setattr(subprocess, "run", hang)
    assert cluster_check._run_child(0, "").transient
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no python")))
    assert cluster_check._run_child(0, "").transient
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: _Done(-6))
    assert not cluster_check._run_child(0, "").transient  # a crash is an answer about the GPU


def test_two_gpus_check_at_once_and_both_verdicts_are_kept(tmp_path, monkeypatch):
    started, release = {}, threading.Event()

    def slow(device_index, debug):
        started[device_index] = True
        assert release.wait(10)
        return ClusterVerdict(True, f"gpu {device_index} ok", "checked")

    monkeypatch.setattr(cluster_check, "_run_child", slow)
    env = KernelSettings(cache_dir=str(tmp_path))
    threads = [threading.Thread(target=cluster_check.verdict_for, args=(i, f"GPU-{i}", "/lib.so", env))
               for i in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    both_running = len(started) == 2  # with one lock for every GPU, the second would wait for the first
    release.set()
    for t in threads:
        t.join(10)
    assert both_running
    table = json.loads((tmp_path / cluster_check.CACHE_FILE).read_text())
    assert sorted(entry["reason"] for entry in table.values()) == ["gpu 0 ok", "gpu 1 ok"]
