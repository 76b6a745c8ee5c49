"""Islands from synthetic pairwise-level matrices (NVML common-ancestor levels) and NUMA nodes."""

from __future__ import annotations

from sglang_sm120.core.topology import Topology, islands_from_levels, kernel_islands

PIX, PXB, PHB, NODE, SYS = 10, 20, 30, 40, 50


def matrix(n, level_of):
    return [[0 if i == j else level_of(i, j) for j in range(n)] for i in range(n)]


def test_two_sockets_of_four():
    levels = matrix(8, lambda i, j: NODE if i // 4 == j // 4 else SYS)
    assert islands_from_levels(levels) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_interleaved_sockets_follow_the_probe_not_rank_div_4():
    levels = matrix(8, lambda i, j: NODE if i % 2 == j % 2 else SYS)
    assert islands_from_levels(levels) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_switch_pairs_inside_two_sockets_split_at_the_socket():
    def level(i, j):
        if i // 2 == j // 2:
            return PIX
        return NODE if i // 4 == j // 4 else SYS

    assert islands_from_levels(matrix(8, level)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_all_behind_one_switch_is_flat():
    assert islands_from_levels(matrix(8, lambda i, j: PXB)) is None


def test_all_same_level_is_flat_without_numa_info():
    assert islands_from_levels(matrix(8, lambda i, j: SYS)) is None


def test_all_same_level_uses_numa_when_known():
    levels = matrix(8, lambda i, j: SYS)
    assert islands_from_levels(levels, [0, 0, 0, 0, 1, 1, 1, 1]) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_unknown_levels_fall_back_to_flat():
    levels = matrix(8, lambda i, j: NODE if i // 4 == j // 4 else SYS)
    levels[2][6] = None
    assert islands_from_levels(levels) is None
    assert islands_from_levels(None) is None
    assert islands_from_levels(levels, [None] * 8) is None


def test_unknown_levels_with_numa():
    levels = matrix(8, lambda i, j: None)
    assert islands_from_levels(levels, [1, 1, 0, 0, 1, 1, 0, 0]) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_irregular_split_is_flat():
    levels = matrix(8, lambda i, j: NODE if (i < 3) == (j < 3) else SYS)
    assert islands_from_levels(levels) is None


def test_small_groups_are_flat():
    assert islands_from_levels(matrix(2, lambda i, j: SYS)) is None
    assert islands_from_levels(matrix(3, lambda i, j: SYS)) is None


def test_four_ranks_two_sockets_gives_pairs_but_kernel_uses_flat():
    islands = islands_from_levels(matrix(4, lambda i, j: NODE if i // 2 == j // 2 else SYS))
    assert islands == [[0, 1], [2, 3]]
    assert kernel_islands(islands, 4) is None


def test_kernel_islands_for_eight():
    assert kernel_islands([[0, 1, 2, 3], [4, 5, 6, 7]], 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert kernel_islands([[0, 1], [2, 3], [4, 5], [6, 7]], 8) is None
    assert kernel_islands(None, 8) is None


def test_link_type():
    assert Topology(None, [], True).link == "nvlink"
    assert Topology(None, [], False).link == "pcie"
    assert Topology(None, [], None).link == "auto"
