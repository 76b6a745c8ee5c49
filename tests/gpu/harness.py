"""Multi-process harness for GPU tests: one spawned process per rank, a gloo group among them, and a verdict
reduced across the group so that a failure on any rank fails the test (and names the rank).

Ranks may outnumber GPUs (rank r uses GPU r % num_gpus): the kernels only need every rank's slab mapped into
every other rank, which CUDA IPC also does between processes on one GPU. Such oversubscribed runs check the
4- and 8-rank schedules for correctness on a 2-GPU machine; they are slow (the GPU time-slices the spinning
kernels of different processes) and say nothing about speed.
"""

from __future__ import annotations

import os
import socket
import time
import traceback

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
    import pytest

    return pytest.mark.skipif(
        not enough_gpus_for(ranks),
        reason=f"needs {ranks} GPUs (or {SHARE_GPUS_ENV}=1 to let ranks share), found {gpu_count()}",
    )


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
