"""The workspace's construction, host side (sgl_kernel_sm120/construction.py): islands and their placement, the
launch limits the ranks agree on, the host-memory workspace's size and its check. (Its rounds over an exchange and
their failures: tests/test_ipc_allreduce.py, tests/test_construction_failures.py.)"""

from __future__ import annotations

import pytest

from sgl_kernel_sm120 import _ext
from sgl_kernel_sm120.construction import (
    Config,
    agree_launch_limits,
    host_file_name,
    placement,
    validate_islands,
)
from sgl_kernel_sm120.policy import Link, Memory, oneshot_max_bytes
from sgl_kernel_sm120.settings import KernelSettings
from tests.fake_ops import LIMITS_JSON, FakeOps
from tests.test_build import _built_library


def test_islands_are_validated_and_placed():
    assert validate_islands(None, 8) is None
    assert validate_islands([[0, 1, 2, 3, 4, 5, 6, 7]], 8) is None  # one island = flat
    islands = validate_islands([[0, 2, 4, 6], [1, 3, 5, 7]], 8)
    assert placement(islands, 5) == ([1, 3, 5, 7], [4, 5], 1, 2)
    assert placement(islands, 0) == ([0, 2, 4, 6], [0, 1], 0, 0)
    with pytest.raises(ValueError, match="partition"):
        validate_islands([[0, 1, 2], [3, 4, 5, 6]], 8)
    with pytest.raises(ValueError, match="same size"):
        validate_islands([[0, 1, 2], [3, 4, 5, 6, 7]], 8)
    with pytest.raises(ValueError, match="partition"):
        validate_islands([[0, 1], [1, 2]], 4)


@pytest.mark.parametrize("num_packs", [1, 31, 2688, 4096, 4097])  # 2688: [3, 7168] bf16
def test_the_eight_rank_island_schedule_s_index_arithmetic(num_packs):
    """The island schedule's ownership as csrc/transports/push.cuh HierStep computes it (owner: the pack's block of
    owner_block_packs, dealt round-robin over the island positions; offset: the owner's blocks one after the other),
    with the chunk csrc/workspace.cu gives each owner: every pack is reduced by one owner per island, the owners are
    twins, an owner's packs get distinct slots inside its chunk, and every rank receives each pack it does not own
    exactly once."""
    world, islands = 8, validate_islands([[0, 1, 2, 3], [4, 5, 6, 7]], 8)
    size, block = len(islands[0]), LIMITS_JSON["owner_block_packs"]

    def owner(g):
        return (g // block) % size

    def offset(g):
        return (g // (block * size)) * block + g % block

    chunk_packs = -(-num_packs // (block * size)) * block
    owners_of = {g: [] for g in range(num_packs)}
    members_of = {}
    for rank in range(world):
        members, twins, island, index = placement(islands, rank)
        assert twins[island] == rank
        members_of[rank] = members
        for g in range(num_packs):
            if owner(g) == index:
                owners_of[g].append(rank)
    for g, owners in owners_of.items():
        assert len(owners) == 2 and owners[1] - owners[0] == 4, (g, owners)  # one per island, twins
    for index in range(size):
        offs = [offset(g) for g in range(num_packs) if owner(g) == index]
        assert len(set(offs)) == len(offs) and (not offs or max(offs) < chunk_packs), (index, offs[-3:])
    received = {rank: {} for rank in range(world)}
    for g, owners in owners_of.items():
        for sender in owners:  # the all-gather: each owner pushes its result to the rest of its island
            for rank in members_of[sender]:
                if rank != sender:
                    received[rank][g] = received[rank].get(g, 0) + 1
    for rank in range(world):
        not_owned = {g for g, owners in owners_of.items() if rank not in owners}
        assert set(received[rank]) == not_owned and set(received[rank].values()) <= {1}, rank


def test_launch_limits_are_agreed_on_the_smallest_gpu_and_every_cluster_check():
    """A group mixing two SKUs launches one grid shape everywhere, and one rank whose cluster check failed takes
    clusters away from every rank."""
    big = {"sm": 170, "capacity": [85, 42, 21], "clusters_ok": True, "reason": "checked"}
    small = {"sm": 84, "capacity": [42, 21, 10], "clusters_ok": True, "reason": "checked"}
    agreed = agree_launch_limits([big, small])
    assert agreed == agree_launch_limits([small, big])  # the order of the ranks does not matter
    assert agreed["sm_budget"] == 84 and agreed["capacity"] == [42, 21, 10] and agreed["clusters"] == [2, 4, 8]
    failed = dict(small, clusters_ok=False, reason="the cluster check failed (exit code 1): illegal instruction")
    agreed = agree_launch_limits([big, failed])
    assert agreed["capacity"] == [0, 0, 0] and agreed["clusters"] == []
    assert agreed["reason"] == "rank 1: the cluster check failed (exit code 1): illegal instruction"
    assert agree_launch_limits([dict(big, capacity=[85, 0, 0])])["clusters"] == [2]


def test_the_host_workspace_is_sized_by_the_one_shot_it_serves():
    """At 8 ranks the host-memory workspace serves one-shot only up to HOST_ONESHOT_MAX_BYTES, so its one-shot slots
    are sized by that: the one-shot regions alone are 2 W^2 x bound (56 MiB at the 458,752 B bound), sized by the 8
    KiB range the whole buffer is 40 MiB smaller. At 2 ranks one-shot serves everything."""
    _built_library()
    sized = _ext.ops().host_shared_bytes_for
    bound = 458752 // 2  # elements of 2 B
    uncapped = sized(8, bound, bound)
    capped = sized(8, bound, oneshot_max_bytes(8, Link.HOST) // 2)
    assert 2 * 8 * 8 * 458752 < uncapped < 70 * 2**20, uncapped
    assert uncapped - capped > 40 * 2**20, (capped, uncapped)
    assert sized(2, bound, min(bound, oneshot_max_bytes(2, Link.HOST) // 2)) == sized(2, bound, bound)
    assert sized(8, 2 * bound, 2 * bound) > uncapped  # a larger bound needs more
    with pytest.raises(RuntimeError, match="oneshot_max_numel <= max_numel"):
        sized(8, bound, 2 * bound)


def test_the_tmpfs_check_names_the_folder_its_space_and_the_size_needed(tmp_path, monkeypatch):
    ops = FakeOps()
    config = Config(0, 0, 2, 1024, 1024, 5.0, 1.0, False, None, Memory.HOST, str(tmp_path))
    name = host_file_name(ops, config, KernelSettings())
    assert name.startswith("sgl_sm120_") and name != host_file_name(ops, config, KernelSettings())
    monkeypatch.setattr(ops, "host_shared_bytes_for", lambda *args: 1 << 60)
    with pytest.raises(RuntimeError, match=f"host memory: {tmp_path} has .* MiB free, the workspace needs .* "
                                           "SGL_SM120_SHM_DIR"):
        host_file_name(ops, config, KernelSettings())
    assert host_file_name(ops, config, KernelSettings(debug_shm_no_precheck=True))  # the allocation meets it then
    missing = Config(0, 0, 2, 1024, 1024, 5.0, 1.0, False, None, Memory.HOST, str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match="host memory: checking the free space of"):
        host_file_name(ops, missing, KernelSettings())
