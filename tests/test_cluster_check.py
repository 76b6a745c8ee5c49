"""The cluster-launch check (sgl_kernel_sm120/cluster_check.py) on CPU: a serving rank only reads the cache; the
check runs in a process that may die (a tune's rank, the doctor's child); what is cached and what is transient.
The check's kernels run on the GPU (tests/gpu/test_ipc_allreduce.py)."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from sgl_kernel_sm120 import cluster_check
from sgl_kernel_sm120.settings import KernelSettings


@pytest.fixture
def checks(monkeypatch):
    """Replaces the check's kernels: records each run and answers with `answer` (a verdict pair or an exception)."""
    runs = []
    answer = {"result": (True, "clusters of 2, 4, 8 CTAs ran")}

    def fake(device_index, debug):
        runs.append((device_index, debug))
        if isinstance(answer["result"], Exception):
            raise answer["result"]
        return answer["result"]

    monkeypatch.setattr(cluster_check, "_check", fake)
    return runs, answer


def test_a_serving_rank_only_reads_the_cache_and_without_a_verdict_launches_no_clusters(tmp_path, checks):
    runs, _ = checks
    env = KernelSettings(cache_dir=str(tmp_path))
    verdict = cluster_check.cached_verdict("GPU-a", "/lib.so", env)
    assert not verdict.ok and verdict.source == "unchecked" and "python -m sglang_sm120.tune" in verdict.reason
    assert runs == []
    assert cluster_check.check_here(0, "GPU-a", "/lib.so", env).ok
    found = cluster_check.cached_verdict("a", "/lib.so", env)  # torch's UUID spelling, without "GPU-"
    assert found.ok and found.source == "cache" and runs == [(0, "")]


def test_switched_off_runs_no_check(tmp_path, checks):
    runs, _ = checks
    env = KernelSettings(fused_clusters=False, cache_dir=str(tmp_path))
    for verdict in (cluster_check.check_here(0, "GPU-a", "/lib.so", env),
                    cluster_check.cached_verdict("GPU-a", "/lib.so", env)):
        assert not verdict.ok and verdict.source == "off" and "SGL_SM120_FUSED_CLUSTERS=off" in verdict.reason
    assert runs == []


def test_verdict_is_cached_per_gpu_and_library(tmp_path, checks):
    runs, answer = checks
    library = tmp_path / "lib.so"
    library.write_bytes(b"x")
    env = KernelSettings(cache_dir=str(tmp_path / "cache"))
    first = cluster_check.check_here(0, "GPU-a", str(library), env)
    again = cluster_check.check_here(0, "GPU-a", str(library), env)
    assert first.ok and first.source == "checked" and again.ok and again.source == "cache"
    assert len(runs) == 1
    answer["result"] = (False, "clusters of 8 CTAs ran but gave other bits")
    other_gpu = cluster_check.check_here(1, "GPU-b", str(library), env)
    assert not other_gpu.ok and len(runs) == 2  # another GPU is checked on its own
    library.write_bytes(b"rebuilt")  # another build of the library: checked again
    assert not cluster_check.check_here(0, "GPU-a", str(library), env).ok and len(runs) == 3
    table = json.loads((tmp_path / "cache" / cluster_check.CACHE_FILE).read_text())
    assert len(table) == 3 and all({"ok", "reason", "when"} <= entry.keys() for entry in table.values())


def test_a_kernel_fault_is_a_property_of_the_gpu_cached_and_says_the_context_is_lost(tmp_path, checks):
    _, answer = checks
    env = KernelSettings(cache_dir=str(tmp_path))
    answer["result"] = RuntimeError("CUDA error: an illegal instruction was encountered")
    verdict = cluster_check.check_here(0, "GPU-a", "/lib.so", env)
    assert not verdict.ok and verdict.context_lost and not verdict.transient
    cached = cluster_check.cached_verdict("GPU-a", "/lib.so", env)
    assert cached.source == "cache" and "illegal instruction" in cached.reason


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: out of memory"), OSError("interrupted")])
def test_a_failure_that_says_nothing_about_the_gpu_is_transient_and_never_cached(tmp_path, checks, error):
    runs, answer = checks
    env = KernelSettings(cache_dir=str(tmp_path))
    answer["result"] = error
    verdict = cluster_check.check_here(0, "GPU-a", "/lib.so", env)
    assert not verdict.ok and verdict.transient and not verdict.context_lost
    assert cluster_check.cached_verdict("GPU-a", "/lib.so", env).source == "unchecked"
    answer["result"] = (True, "clusters ran")
    assert cluster_check.check_here(0, "GPU-a", "/lib.so", env).ok and len(runs) == 2


def test_the_debug_switch_runs_the_trapping_check_past_the_cache_and_fails_every_workspace(tmp_path, checks):
    runs, answer = checks
    env = KernelSettings(cache_dir=str(tmp_path), debug_cluster_check="trap")
    answer["result"] = RuntimeError("CUDA error: unspecified launch failure")
    verdict = cluster_check.check_here(0, "GPU-a", "/lib.so", env)
    assert not verdict.ok and verdict.context_lost and runs == [(0, "trap")]
    assert not (tmp_path / cluster_check.CACHE_FILE).exists()
    cached = cluster_check.cached_verdict("GPU-a", "/lib.so", env)
    assert not cached.ok and cached.source == "debug" and "cluster check" in cached.reason


class _Done:
    def __init__(self, returncode, stdout="", stderr=""):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.mark.parametrize(
    "outcome, ok, transient, says",
    [
        (_Done(0, 'noise\n{"ok": true, "reason": "clusters of 2, 4, 8 CTAs ran", "source": "checked"}\n'), True,
         False, "clusters of 2, 4, 8"),
        (_Done(0, '{"ok": false, "reason": "the cluster check failed (illegal instruction)", "source": "checked", '
                  '"context_lost": true}\n'), False, False, "illegal instruction"),
        (_Done(-6, "", "Aborted"), False, True, "exit code -6"),
    ],
)
def test_the_doctors_child_outcome_becomes_a_verdict(monkeypatch, tmp_path, outcome, ok, transient, says):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: outcome)
    verdict = cluster_check.verdict_for(0, "GPU-a", "/lib.so", KernelSettings(cache_dir=str(tmp_path)))
    assert verdict.ok is ok and verdict.transient is transient and says in verdict.reason, verdict


def test_a_doctors_child_that_hangs_or_cannot_start_gives_a_transient_verdict(monkeypatch, tmp_path):
    env = KernelSettings(cache_dir=str(tmp_path))

    def hang(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))

    monkeypatch.setattr(subprocess, "run", hang)
    assert cluster_check.verdict_for(0, "GPU-a", "/lib.so", env).transient
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(OSError("no python")))
    assert cluster_check.verdict_for(0, "GPU-a", "/lib.so", env).transient


def test_two_gpus_check_at_once_and_both_verdicts_are_kept(tmp_path, monkeypatch):
    started, release = {}, threading.Event()

    def slow(device_index, debug):
        started[device_index] = True
        assert release.wait(10)
        return True, f"gpu {device_index} ok"

    monkeypatch.setattr(cluster_check, "_check", slow)
    env = KernelSettings(cache_dir=str(tmp_path))
    threads = [threading.Thread(target=cluster_check.check_here, args=(i, f"GPU-{i}", "/lib.so", env))
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
