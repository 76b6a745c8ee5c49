"""GPU tests of IpcAllReduce(memory="host"): the workspace in shared pinned host memory (GPUs without P2P).

The scenarios of tests/gpu/test_ipc_allreduce.py (exact integer sums and bitwise agreement across ranks, special
values, graph replays, back-to-back calls, create/close, a rank that skips a call, a dropped probe write and a
corrupted probe read), run with the host-memory workspace (`SGL_SM120_TEST_MEMORY=host` in the environment the
spawned ranks inherit), the two-rank ones on one pair of ranks as there. On one GPU the ranks share it; the data path
through host memory is the same as on two GPUs. Also the tmpfs that holds it being too small (Docker and Kubernetes
give /dev/shm 64 MiB): a named IpcAllReduceHostMemoryError on every rank, no SIGBUS, nothing left in the folder.
"""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.gpu import test_ipc_allreduce as scenarios
from tests.gpu.harness import (
    need_ranks,
    run_ranks,
    run_scenarios,
    selected_scenarios,
    shared_cluster_cache,  # noqa: F401 - a fixture
    spawn_env,
    synchronize,
)
from tests.gpu.test_ipc_allreduce import passed
from tests.support.env import spelled_out

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cluster_cache")]


def _shared_files() -> set[str]:
    return set(glob.glob("/dev/shm/sgl_sm120_*"))


@pytest.fixture(autouse=True)
def host_memory(monkeypatch):
    monkeypatch.setenv(scenarios.MEMORY_ENV, "host")
    before = _shared_files()
    yield
    left = _shared_files() - before
    assert not left, f"shared-memory names left behind: {sorted(left)}"


TWO_RANKS = {
    "test_hostmem_exact_sums_all_shapes_schedules_dtypes":
        (scenarios._scenario_exact_shapes, (scenarios.ROWS, scenarios.HIDDENS, scenarios.DTYPES)),
    "test_hostmem_random_and_special_values": (scenarios._scenario_random_and_special_values, ()),
    "test_hostmem_back_to_back_calls": (scenarios._scenario_back_to_back, (150,)),
    "test_hostmem_graph_replays": (scenarios._scenario_graph, (21, 12)),
    "test_hostmem_create_close_does_not_leak": (scenarios._scenario_create_close, (16,)),
    "test_hostmem_probe_names_a_dropped_write_and_a_corrupted_read": (scenarios._scenario_probe_drops, ()),
    "test_hostmem_calls_from_two_streams_keep_the_host_s_order":
        (scenarios._scenario_two_streams_keep_the_call_order, ()),
    "test_hostmem_rank_skipping_a_call_ends_in_timeout_error_exit_mode":
        (scenarios._scenario_rank_skips_a_call, ("exit",)),
    "test_hostmem_rank_skipping_a_call_ends_in_timeout_error_not_hang":
        (scenarios._scenario_rank_skips_a_call, ("trap",)),
}


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    before = _shared_files()  # the run precedes every test's own check
    with spawn_env(tmp_path_factory, **{scenarios.MEMORY_ENV: "host"}):
        outcomes = run_scenarios(2, selected_scenarios(request, TWO_RANKS), timeout_s=600)
    left = _shared_files() - before
    assert not left, f"shared-memory names left behind by the two-rank scenarios: {sorted(left)}"
    return outcomes


@need_ranks(2)
def test_hostmem_exact_sums_all_shapes_schedules_dtypes(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_random_and_special_values(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_back_to_back_calls(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_graph_replays(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_create_close_does_not_leak(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_probe_names_a_dropped_write_and_a_corrupted_read(two_ranks, request):
    # Pull runs over host memory too; its loads of a peer's slab there cross the GPU's PCIe read path to host
    # memory through the IOMMU, so the probe loads there too, and must name a corrupted read, there as well.
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_calls_from_two_streams_keep_the_host_s_order(two_ranks, request):
    # I6 holds whatever the memory: the order between streams is the host's, and host memory's emptying stores are
    # fenced inside each call (I11).
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_rank_skipping_a_call_ends_in_timeout_error_exit_mode(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_hostmem_rank_skipping_a_call_ends_in_timeout_error_not_hang(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
@pytest.mark.parametrize("world", [4, 8])
def test_hostmem_exact_sums_oversubscribed(world):
    run_ranks(world, scenarios._scenario_exact_shapes, [1, 3, 64], [7168, 8], [torch.bfloat16], 30.0, timeout_s=150)


@need_ranks(2)
@pytest.mark.parametrize("world", [4, 8])
def test_hostmem_rank_skipping_a_call_ends_in_timeout_error_on_every_rank_exit_mode(world):
    run_ranks(world, scenarios._scenario_rank_skips_a_call, "exit", timeout_s=240)


def _scenario_tmpfs_too_small(rank, world, max_numel, folder, expect):
    from sgl_kernel_sm120 import IpcAllReduceHostMemoryError

    before = set(os.listdir(folder))
    try:
        scenarios._make(world, rank, max_numel)
    except IpcAllReduceHostMemoryError as err:
        text = str(err)
        for part in (folder, "free", "needs", "SGL_SM120_SHM_DIR", *expect):
            assert part in text, f"{part!r} missing from: {text}"
    else:
        raise AssertionError(f"a host-memory workspace of {max_numel} elements fit into {folder}")
    dist.barrier()
    left = set(os.listdir(folder)) - before
    assert not left, f"files left in {folder}: {sorted(left)}"
    # The process is alive (no SIGBUS) and a workspace that fits, in the default folder, still works.
    for name in (*spelled_out("SGL_SM120_SHM_DIR", ""), *spelled_out("SGL_SM120_DEBUG_SHM_NO_PRECHECK", "")):
        os.environ.pop(name, None)
    ar = scenarios._make(world, rank, 64 * 7168)
    try:
        x = torch.ones(3, 7168, dtype=torch.bfloat16, device=torch.device("cuda", torch.cuda.current_device()))
        out = ar.all_reduce(x)
        synchronize(ar)
        assert torch.equal(out, torch.full_like(x, world)), "wrong sum after the failed workspace"
    finally:
        ar.close()


@need_ranks(2)
def test_hostmem_larger_than_the_tmpfs_is_refused_before_allocating():
    """The size check: a workspace larger than /dev/shm's free space is refused, naming the folder and sizes."""
    stat = os.statvfs("/dev/shm")
    free = stat.f_bavail * stat.f_frsize
    max_numel = (free // 2 // 8 + 8) * 8  # 2 ranks x (2 parities x 2 one-shot slots) x this x 2 B > free
    run_ranks(2, _scenario_tmpfs_too_small, max_numel, "/dev/shm", ("has",), timeout_s=180)


# A 2-rank host-memory workspace of this many elements: one slab fits a 4 MiB tmpfs, two do not.
SMALL_TMPFS_MAX_NUMEL = 128 * 1024


@need_ranks(2)
def test_hostmem_on_a_full_tmpfs_is_a_named_error_not_sigbus(monkeypatch):
    """The allocation itself: on a 4 MiB tmpfs with the size check skipped (a debug switch), rank 0's slab fits and
    rank 1's posix_fallocate fails: every rank raises the named error and the creator removes the file."""
    from sgl_kernel_sm120 import _ext

    slab = int(_ext.ops().host_shared_bytes_for(2, SMALL_TMPFS_MAX_NUMEL, SMALL_TMPFS_MAX_NUMEL)) // 2
    assert slab < 4 << 20 < 2 * slab, f"a slab of {slab} B: the scenario needs one to fit 4 MiB and two not"
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder = tempfile.mkdtemp(prefix="sgl_sm120_small_tmpfs_")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", folder], capture_output=True, text=True)
    if mounted.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        for name, value in {**spelled_out("SGL_SM120_SHM_DIR", folder),
                            **spelled_out("SGL_SM120_DEBUG_SHM_NO_PRECHECK", "1")}.items():
            monkeypatch.setenv(name, value)
        run_ranks(2, _scenario_tmpfs_too_small, SMALL_TMPFS_MAX_NUMEL, folder,
                  ("No space left on device", "rank 1:"), timeout_s=180)
    finally:
        subprocess.run(["umount", folder], check=False)
        os.rmdir(folder)
