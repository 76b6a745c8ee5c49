"""Multi-process harness for GPU tests: one spawned process per rank, a gloo group among them, and a verdict
reduced across the group so that a failure on any rank fails the test (and names the rank).

Ranks may outnumber GPUs (rank r uses GPU r % num_gpus): the kernels only need every rank's slab mapped into
every other rank, which CUDA IPC also does between processes on one GPU. Such oversubscribed runs check the
4- and 8-rank schedules for correctness on a 2-GPU machine; they are slow (the GPU time-slices the spinning
kernels of different processes) and say nothing about speed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# "1": a test of N ranks runs on fewer GPUs, ranks sharing them (rank r on GPU r % count). Correctness only: CUDA
# IPC works between processes on one GPU, the tests' own collectives are gloo, and timings mean nothing.
SHARE_GPUS_ENV = "SGL_SM120_TEST_SHARE_GPUS"
# After a rank exits without a verdict, how long its peers' verdicts are still waited for.
DEAD_RANK_GRACE_S = 20.0


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def enough_gpus_for(ranks: int) -> bool:
    have = gpu_count()
    return have >= ranks or (have >= 1 and os.environ.get(SHARE_GPUS_ENV) == "1")


def need_ranks(ranks: int):
    """skipif for a test of `ranks` processes: one GPU each, or any GPUs at all with SGL_SM120_TEST_SHARE_GPUS=1."""
    return pytest.mark.skipif(
        not enough_gpus_for(ranks),
        reason=f"needs {ranks} GPUs (or {SHARE_GPUS_ENV}=1 to let ranks share), found {gpu_count()}",
    )


def dirty_halves(workspace) -> int:
    """Half-words of a workspace's scratch that are not empty: 0 after every completed call (I4). Synchronizes."""
    from sgl_kernel_sm120 import _ext

    return int(_ext.ops().ws_dirty_halves(workspace._handle))


def synchronize(workspace) -> None:
    """torch.cuda.synchronize for the workspace's device; a timeout a kernel recorded raises as
    IpcAllReduceTimeoutError (also when the synchronize itself failed: the trap ended the context)."""
    try:
        torch.cuda.synchronize(workspace.device)
    except Exception as exc:  # RuntimeError, or torch.AcceleratorError where torch has it
        if (err := workspace.timeout_error()) is not None:
            raise err from exc
        raise
    if (err := workspace.timeout_error()) is not None:
        raise err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn, args, queue, hang_report_s: float) -> None:
    import faulthandler
    import sys

    # A rank that hangs prints where every thread is, shortly before the parent gives up and kills it; one that
    # crashes (SIGSEGV, SIGBUS, SIGABRT) prints where it was first.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.dump_traceback_later(hang_report_s, exit=False, file=sys.stderr)
    verdict = None
    try:
        if torch.cuda.is_available():  # (the SGLang harness's CPU dry run has no GPU)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            local = None
            try:
                fn(rank, world, *args)
            except BaseException:  # noqa: B036 - report everything, then share it with the group
                local = traceback.format_exc()
            verdicts: list = [None] * world
            dist.all_gather_object(verdicts, local)
            failures = {r: v for r, v in enumerate(verdicts) if v}
            if failures:
                verdict = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(failures.items()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: B036
        verdict = verdict or f"--- rank {rank} (harness) ---\n{traceback.format_exc()}"
    queue.put((rank, verdict))


def _scenarios(rank: int, world: int, scenarios, record: str) -> None:
    """Every rank runs each (name, fn, args) in turn; each outcome is agreed over the group (which also keeps the
    ranks in step from one scenario to the next) and rank 0 records it as it ends."""
    import json

    for name, fn, args in scenarios:
        local = None
        try:
            fn(rank, world, *args)
        except BaseException:  # noqa: B036 - reported for this scenario, then the next one runs
            local = traceback.format_exc()
        verdicts: list = [None] * world
        dist.all_gather_object(verdicts, local)
        failed = "\n".join(f"--- rank {r} ---\n{v}" for r, v in enumerate(verdicts) if v) or None
        if rank == 0:
            with open(record, "a") as handle:
                handle.write(json.dumps({"name": name, "failure": failed}) + "\n")


def run_scenarios(world: int, scenarios: list, timeout_s: float) -> dict[str, str | None]:
    """Run (name, fn, args) scenarios one after another on the same `world` spawned ranks: one start (processes,
    CUDA, gloo) for many tests, each of which then asserts its own scenario's outcome. Returns name -> None (passed
    on every rank) or the failure; a scenario that never ended (a hang or crash) gets the run's own failure."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        record = os.path.join(folder, "outcomes.jsonl")
        open(record, "w").close()
        try:
            run_ranks(world, _scenarios, scenarios, record, timeout_s=timeout_s)
            problem = "the run ended before it"
        except AssertionError as exc:
            problem = str(exc)
        with open(record) as handle:
            done = {entry["name"]: entry["failure"] for entry in map(json.loads, handle)}
    return {name: done.get(name, f"did not finish: {problem}") for name, _, _ in scenarios}


def selected_scenarios(request, scenarios: dict) -> list:
    """The (name, fn, args) of `scenarios` (test name -> (fn, args), in run order) whose test this session runs."""
    wanted = {item.name for item in request.session.items if item.module is request.module}
    return [(name, fn, args) for name, (fn, args) in scenarios.items() if name in wanted]


def _cluster_cache(tmp_path_factory) -> str:
    """The session's cluster-check cache, every visible GPU checked once as the tune checks it (in a process that may
    die: here the check's own child), so the tests' workspaces launch clusters where the GPU runs them."""
    import subprocess
    import sys

    folder = tmp_path_factory.getbasetemp() / "sm120-gpu-cluster-cache"
    if not folder.exists():
        folder.mkdir()
        env = {**os.environ, "SGLANG_SM120_CACHE": str(folder)}
        for index in range(gpu_count()):
            subprocess.run([sys.executable, "-m", "sgl_kernel_sm120.cluster_check", str(index)], env=env,
                           capture_output=True, text=True, timeout=300)
    return str(folder)


@contextlib.contextmanager
def spawn_env(tmp_path_factory, **variables: str):
    """The environment ranks spawned inside it inherit: one cluster-check cache for the kernel GPU tests of a session
    (never the user's; the check's child process then runs once per GPU and library, not once per test) and
    `variables`. For a fixture wider than a test, which runs before the tests' own environment fixtures."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_SM120_CACHE", _cluster_cache(tmp_path_factory))
        for name, value in variables.items():
            patch.setenv(name, value)
        yield


@pytest.fixture
def shared_cluster_cache(private_cache, monkeypatch, tmp_path_factory) -> None:
    """spawn_env's cluster-check cache for a test that spawns its own ranks."""
    monkeypatch.setenv("SGLANG_SM120_CACHE", _cluster_cache(tmp_path_factory))


def run_ranks(world: int, fn, *args, timeout_s: float = 300.0) -> None:
    """Run fn(rank, world, *args) on `world` processes; raise AssertionError naming every failing rank.

    fn must be a module-level function (it is pickled for spawn). The whole run is bounded by timeout_s:
    ranks still alive then are killed and the test fails instead of hanging.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    hang_report_s = max(timeout_s - 15.0, 5.0)
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue, hang_report_s)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, str | None] = {}
    deadline = time.monotonic() + timeout_s
    died_at = None
    # Wait for every verdict, but not the whole bound for a rank that died without one (a crash in a spawned
    # process, e.g. an import error): its peers would only wait for it in a collective until the deadline.
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, verdict = queue.get(timeout=1.0)
            results[rank] = verdict
            continue
        except Exception:  # queue.Empty
            pass
        dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
        if dead and died_at is None:
            died_at = time.monotonic()  # a verdict put just before exiting may still be in the pipe
        if died_at is not None and time.monotonic() - died_at > DEAD_RANK_GRACE_S:
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    missing = sorted(set(range(world)) - set(results))
    problems = [v for v in results.values() if v]
    if missing:
        exits = {r: procs[r].exitcode for r in missing}
        problems.append(f"ranks {missing} reported nothing within {timeout_s:.0f} s (hang or crash; exit codes "
                        f"{exits}, None: killed when the run ended)")
    assert not problems, "\n".join(dict.fromkeys(problems))
