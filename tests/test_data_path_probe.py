"""The data-path probe's host side (sgl_kernel_sm120/data_path_probe.py): what the debug switch hands the kernel, how
the outcomes become named pairs, and that the probe is one round whatever the slab's size."""

from __future__ import annotations

import pytest

from sgl_kernel_sm120 import data_path_probe as probe
from sgl_kernel_sm120.errors import IpcAllReduceProbeError
from sgl_kernel_sm120.settings import ProbeDrop
from tests.fake_ops import FakeOps, run_threads


@pytest.mark.parametrize("drop, rank, memory, target", [
    (None, 1, "device", (-1, 0)),
    (ProbeDrop(1, 0), 1, "device", (0, 1 | 2)),  # no part: its writes and its loads
    (ProbeDrop(1, 0), 0, "device", (-1, 0)),  # another rank's drop
    (ProbeDrop(1, 0, "write"), 1, "device", (0, 1)),
    (ProbeDrop(1, 0, "read"), 1, "device", (0, 2)),
    (ProbeDrop(1, 0, "last"), 1, "device", (0, 1 | 4)),  # the last page only: a mapping broken for part of a slab
    (ProbeDrop(1, 0), 1, "host", (-1, 0)),  # a broken P2P path: device memory only, unless asked
    (ProbeDrop(1, 0, None, "host"), 1, "host", (0, 3)),
    (ProbeDrop(1, 0, None, "host"), 1, "device", (-1, 0)),
    (ProbeDrop(1, 0, "last", "any"), 1, "host", (0, 5)),
])
def test_the_debug_drop_names_its_peer_and_what_it_drops_in_the_memory_it_says(drop, rank, memory, target):
    assert probe.drop_target(drop, rank, memory) == target


def _row(*per_peer):
    """A receiver's table as the ws_probe op hands it: per peer (write outcome, offset, read outcome, offset)."""
    return [number for entry in per_peer for number in entry]


FINE = (0, -1, 0, -1)


def test_outcomes_name_the_failing_pairs_and_the_place():
    assert probe.failed_pairs([_row(FINE, FINE), _row(FINE, FINE)]) == []
    # row = receiver: rank 0 never got rank 1's pack, rank 1 got garbage from rank 0
    tables = [_row(FINE, (2, 8192, 0, -1)), _row((3, 4096, 0, -1), FINE)]
    assert probe.failed_pairs(tables, lambda at: f"page {at}") == [
        (1, 0, "write never arrived (page 8192)"), (0, 1, "wrong data arrived (page 4096)")]


def test_a_failed_read_is_named_by_reader_and_owner_and_both_kinds_of_one_pair_are_named():
    tables = [_row(FINE, FINE, FINE), _row((0, -1, 5, 12288), FINE, FINE), _row(FINE, (2, 4096, 4, 12304), FINE)]
    assert probe.failed_pairs(tables, lambda at: f"at {at}") == [
        (0, 1, "rank 1's loads from rank 0 returned wrong data (at 12288)"),
        (1, 2, "write never arrived (at 4096)"),
        (1, 2, "rank 2's loads from rank 1 never returned the pattern (at 12304)"),
    ]
    assert probe.failed_pairs([_row(FINE, (9, -1, 0, -1)), _row(FINE, FINE)]) == [(1, 0, "outcome 9")]


@pytest.mark.parametrize("world", [2, 8])
def test_the_probe_is_one_round_and_a_failure_is_the_probe_error_on_every_rank(world):
    ops = FakeOps(probe_outcome=2, world=world)

    def run(rank, exchange):
        try:
            probe.run(ops, 1, exchange, "device", 5.0)
        except IpcAllReduceProbeError as exc:
            return exchange.rounds, exchange.barriers, exc.pairs
        raise AssertionError("the failed probe did not raise")

    answers = run_threads(world, run)
    pairs = [(s, r, "write never arrived (the page at slab byte 4096)") for r in range(world) for s in range(world)
             if s != r]
    assert answers == [(1, 1, pairs)] * world, answers[0]  # one probe round, then the barrier of the unmapping
    healthy = FakeOps(world=world)
    assert run_threads(world, lambda rank, ex: (probe.run(healthy, 1, ex, "device", 5.0), ex.rounds)[1]) == [1] * world
