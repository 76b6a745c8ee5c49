"""A step of the workspace's construction that fails on one rank only ends the same way on every rank, at once:
the ranks are separate processes on a gloo group (as SGLang's), the library is a stand-in that fails where a
scenario says. A rank that left construction between two collectives would leave its peers waiting in the next
one for the group's timeout (hours in SGLang; GROUP_TIMEOUT_S here, which a pass never comes near). The same
properties over an exchange whose ranks are threads: tests/test_ipc_allreduce.py."""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.fake_ops import FakeOps

WORLD = 2
GROUP_TIMEOUT_S = 20
FULL_TMPFS = ("host memory: allocating this rank's slab in /dev/shm failed (No space left on device): /dev/shm has "
              "0.5 MiB free, the workspace needs 1.0 MiB")


def _rank(rank: int, port: int, scenario: str, failing_rank: int, queue) -> None:
    from sgl_kernel_sm120 import construction, data_path_probe
    from sgl_kernel_sm120.exchange import exchange_of
    from sgl_kernel_sm120.policy import Memory
    from sgl_kernel_sm120.settings import KernelSettings

    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("sgl_kernel_sm120").addHandler(Collect(level=logging.WARNING))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    op = {"ipc_handle": "ws_ipc_handle", "unlink": "ws_unlink_shared", "close_peers": "ws_close_peers",
          "full_tmpfs": None}[scenario]
    ops = FakeOps(op if rank == failing_rank else None, probe_outcome=2 if scenario == "close_peers" else 0,
                  world=WORLD)
    if scenario == "full_tmpfs" and rank == failing_rank:
        def out_of_space(*args):  # the library's error for a slab that no longer fits its tmpfs
            raise torch.cuda.OutOfMemoryError(f"sgl_kernel_sm120: {FULL_TMPFS}\nException raised from ws_create")

        ops.ws_create = out_of_space
    exchange = exchange_of(dist.group.WORLD)
    memory = Memory.HOST if scenario in ("unlink", "full_tmpfs") else Memory.DEVICE
    config = construction.Config(0, rank, WORLD, 1024, 1024, 5.0, 1.0, False, None, memory,
                                 shm_dir=tempfile.gettempdir())
    try:
        if scenario == "close_peers":
            data_path_probe.run(ops, 1, exchange, "device", 5.0)
        else:
            name = "sgl_sm120_test" if memory is Memory.HOST else ""
            construction.build(ops, exchange, config, KernelSettings(), name)
        outcome = "returned"
    except Exception as exc:  # reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()
    queue.put((rank, outcome, warnings, sorted(ops.live)))


def _run(scenario: str, failing_rank: int) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, scenario, failing_rank, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        answers = sorted(queue.get(timeout=GROUP_TIMEOUT_S + 60) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return answers


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_an_ipc_handle_that_fails_on_one_rank_fails_the_allocation_on_every_rank(failing_rank):
    answers = _run("ipc_handle", failing_rank)
    for rank, outcome, _, live in answers:
        assert outcome.startswith("IpcAllReduceError: IpcAllReduce workspace allocation failed"), (rank, outcome)
        assert live == [], f"rank {rank} left a workspace built: {live}"
        assert f"rank {failing_rank}: RuntimeError: ws_ipc_handle: stand-in failure" in outcome, (rank, outcome)
        assert "timed out" not in outcome.lower() and "timeout" not in outcome.lower(), (rank, outcome)


def test_removing_the_shared_files_name_failing_is_a_warning_not_a_split():
    answers = _run("unlink", 0)
    assert [outcome for _, outcome, _, _ in answers] == ["returned", "returned"], answers
    rank0_warnings = answers[0][2]
    assert any("removing the host-memory workspace's file" in w and "remove the file by hand" in w
               for w in rank0_warnings), rank0_warnings


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failed_probe_is_the_probes_error_on_every_rank_also_when_unmapping_fails(failing_rank):
    answers = _run("close_peers", failing_rank)
    for rank, outcome, _, _ in answers:
        assert outcome.startswith("IpcAllReduceProbeError: CUDA P2P data path probe failed"), (rank, outcome)
    assert any("unmapping the peers after the failed probe" in w for w in answers[failing_rank][2]), answers


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_tmpfs_that_fills_up_at_allocation_is_the_host_memory_error_with_its_remedy_on_every_rank(failing_rank):
    from sgl_kernel_sm120.construction import SHM_ADVICE

    answers = _run("full_tmpfs", failing_rank)
    for rank, outcome, _, live in answers:
        assert outcome.startswith("IpcAllReduceHostMemoryError: IpcAllReduce host-memory workspace"), (rank, outcome)
        assert f"rank {failing_rank}: IpcAllReduceHostMemoryError: {FULL_TMPFS}; {SHM_ADVICE}" in outcome, \
            (rank, outcome)
        assert "SGL_SM120_SHM_DIR" in outcome and "Exception raised from" not in outcome, (rank, outcome)
        assert live == [], f"rank {rank} left a workspace built: {live}"
