"""The data-path probe's host side (sgl_kernel_sm120/data_path_probe.py): which peer the debug switch fails with in
which round, and how the outcomes become named pairs."""

from __future__ import annotations

import pytest

from sgl_kernel_sm120 import data_path_probe as probe
from sgl_kernel_sm120.settings import ProbeDrop


@pytest.mark.parametrize("drop, rank, round_index, memory, reads, target", [
    (None, 1, 0, "device", False, -1),
    (ProbeDrop(1, 0), 1, 0, "device", False, 0),
    (ProbeDrop(1, 0), 0, 0, "device", False, -1),  # another rank's drop
    (ProbeDrop(1, 0, 5), 1, 5, "device", False, 0),  # one round only: a mapping broken for part of the slab
    (ProbeDrop(1, 0, 5), 1, 4, "device", False, -1),
    (ProbeDrop(1, 0), 1, 12, "device", True, 0),  # no round: every round, the read rounds too
    (ProbeDrop(1, 0, "read"), 1, 3, "device", False, -1),  # `read`: the read rounds only
    (ProbeDrop(1, 0, "read"), 1, 12, "device", True, 0),
    (ProbeDrop(1, 0), 1, 0, "host", False, -1),  # a broken P2P path: device memory only, unless asked
    (ProbeDrop(1, 0, None, "host"), 1, 0, "host", False, 0),
    (ProbeDrop(1, 0, None, "host"), 1, 0, "device", False, -1),
    (ProbeDrop(1, 0, 5, "any"), 1, 5, "host", False, 0),
])
def test_the_debug_drop_names_its_peer_in_the_rounds_and_memory_it_says(drop, rank, round_index, memory, reads,
                                                                       target):
    assert probe.drop_target(drop, rank, round_index, memory, reads) == target


def test_outcomes_name_the_failing_pairs_and_the_round():
    assert probe.failed_pairs([[1, 1], [1, 1]]) == []
    # row = receiver: rank 0 never got rank 1's pack, rank 1 got garbage from rank 0
    assert probe.failed_pairs([[1, 2], [3, 1]]) == [(1, 0, "write never arrived"), (0, 1, "wrong data arrived")]
    assert probe.failed_pairs([[1, 2], [1, 1]], "parity 1, the end of the region") == [
        (1, 0, "write never arrived (parity 1, the end of the region)")]


def test_a_failed_read_is_named_by_reader_and_owner():
    where = "parity 0, peer loads from the pull area"
    assert probe.failed_pairs([[1, 1, 1], [5, 1, 1], [1, 4, 1]], where) == [
        (0, 1, f"rank 1's loads from rank 0 returned wrong data ({where})"),
        (1, 2, f"rank 2's loads from rank 1 never returned the pattern ({where})"),
    ]
    assert probe.failed_pairs([[1, 9], [1, 1]]) == [(1, 0, "outcome 9")]  # an outcome added later is still named
