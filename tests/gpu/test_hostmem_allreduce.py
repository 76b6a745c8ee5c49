"""GPU tests of IpcAllReduce(memory="host"): the workspace in shared pinned host memory (GPUs without P2P).

Also the tmpfs that holds it being too small (Docker and Kubernetes give /dev/shm 64 MiB): a named
IpcAllReduceHostMemoryError on every rank, no SIGBUS, nothing left in the folder.

The same scenarios as tests/gpu/test_ipc_allreduce.py (exact integer sums and bitwise agreement across ranks,
special values, graph replays, back-to-back calls, create/close, a rank that skips a call, a dropped probe
write, a corrupted probe read), run with the host-memory workspace: `SGL_SM120_TEST_MEMORY=host` in the
environment the spawned ranks inherit. On one GPU the ranks share it (SGL_SM120_TEST_SHARE_GPUS=1); the data
path through host memory is the same as on two GPUs.
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
from tests.gpu.harness import need_ranks, run_ranks

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def host_memory(monkeypatch):
    monkeypatch.setenv(scenarios.MEMORY_ENV, "host")
    before = set(glob.glob("/dev/shm/sgl_sm120_*"))
    yield
    left = set(glob.glob("/dev/shm/sgl_sm120_*")) - before
    assert not left, f"shared-memory names left behind: {sorted(left)}"


@need_ranks(2)
def test_hostmem_exact_sums_all_shapes_variants_dtypes():
    # Bounds about 5x the runs that passed: a hang (seen 2026-12-02, in construction) must not eat a GPU session.
    run_ranks(2, scenarios._scenario_exact_shapes, scenarios.ROWS, scenarios.HIDDENS, scenarios.DTYPES, timeout_s=150)


@need_ranks(2)
@pytest.mark.parametrize("world", [4, 8])
def test_hostmem_exact_sums_oversubscribed(world):
    run_ranks(world, scenarios._scenario_exact_shapes, [1, 3, 64], [7168, 8], [torch.bfloat16], 30.0, timeout_s=150)


@need_ranks(2)
def test_hostmem_special_values():
    run_ranks(2, scenarios._scenario_special_values, timeout_s=120)


@need_ranks(2)
def test_hostmem_back_to_back_calls():
    run_ranks(2, scenarios._scenario_back_to_back, 300, timeout_s=150)


@need_ranks(2)
def test_hostmem_graph_replays():
    run_ranks(2, scenarios._scenario_graph, 20, 50, timeout_s=200)


@need_ranks(2)
def test_hostmem_create_close_does_not_leak():
    run_ranks(2, scenarios._scenario_create_close, 30, timeout_s=120)


@need_ranks(2)
def test_hostmem_rank_skipping_a_call_ends_in_timeout_error_not_hang():
    run_ranks(2, scenarios._scenario_rank_skips_a_call, "trap", timeout_s=120)


@need_ranks(2)
@pytest.mark.parametrize("world", [2, 4, 8])
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
    # The process is alive (no SIGBUS) and a workspace that fits still works.
    os.environ.pop("SGL_SM120_SHM_DIR", None)
    ar = scenarios._make(world, rank, 64 * 7168)
    try:
        x = torch.ones(3, 7168, dtype=torch.bfloat16, device=torch.device("cuda", torch.cuda.current_device()))
        out = ar.all_reduce(x)
        ar.synchronize()
        assert torch.equal(out, torch.full_like(x, world)), "wrong sum after the failed workspace"
    finally:
        ar.close()


@need_ranks(2)
def test_hostmem_larger_than_the_tmpfs_is_refused_before_allocating(monkeypatch):
    """The size check: a workspace larger than /dev/shm's free space is refused, naming the folder and sizes."""
    stat = os.statvfs("/dev/shm")
    free = stat.f_bavail * stat.f_frsize
    max_numel = (free // 2 // 8 + 8) * 8  # 2 ranks x (2 parities x 2 one-shot slots) x this x 2 B > free
    run_ranks(2, _scenario_tmpfs_too_small, max_numel, "/dev/shm", ("has",), timeout_s=180)


@need_ranks(2)
def test_hostmem_on_a_full_tmpfs_is_a_named_error_not_sigbus(monkeypatch):
    """The allocation itself: on a 4 MiB tmpfs with the size check skipped (a debug switch), rank 0's slab fits
    and rank 1's posix_fallocate fails: every rank raises the named error and the creator removes the file."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder = tempfile.mkdtemp(prefix="sgl_sm120_small_tmpfs_")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", folder], capture_output=True, text=True)
    if mounted.returncode != 0:
        os.rmdir(folder)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        from sgl_kernel_sm120.env import spelled_out

        for name, value in {**spelled_out("SGL_SM120_SHM_DIR", folder),
                            **spelled_out("SGL_SM120_DEBUG_SHM_NO_PRECHECK", "1")}.items():
            monkeypatch.setenv(name, value)
        # 2 ranks: a parity region is the larger of 2 one-shot slots (2 x 2 B x n) and the staged slots (6 chunks of
        # 2 B x n / 2), so 6 n bytes, and a slab (2 parities + a page) 12 n bytes: 3 MiB + 4 KiB at n = 256 Ki.
        max_numel = 256 * 1024
        run_ranks(2, _scenario_tmpfs_too_small, max_numel, folder, ("No space left on device",), timeout_s=180)
    finally:
        subprocess.run(["umount", folder], check=False)
        os.rmdir(folder)


@need_ranks(2)
def test_hostmem_probe_names_a_dropped_pair():
    run_ranks(2, scenarios._scenario_probe_drop, timeout_s=120)


@need_ranks(2)
def test_hostmem_probe_names_a_corrupted_peer_read():
    # Pull runs over host memory too; its loads of a peer's slab there cross the GPU's PCIe read path to host
    # memory through the IOMMU, so the read rounds run, and must name a corrupted read, there as well.
    run_ranks(2, scenarios._scenario_probe_read_drop, timeout_s=120)
