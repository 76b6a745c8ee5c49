"""The construction probe's read places (csrc/probe.cu R1, R2), checked on the host: tests/probe_places_check.cu
is compiled with the sources and run, for 2, 4 and 8 ranks, with and without islands, at several sizes.

It fails when two readers (or two places of one reader) share a place, since the first to empty its pack would
make the other see only the fill on a healthy fabric; when a place leaves the part of the pull area it stands for;
when some first or last pack of a part (where pull's loads start and end) is loaded by nobody; when the round
kinds are not the write rounds followed by one read round per parity; and when no write round reaches an end of
the flag area (which holds the flags of both call parities).
"""

from __future__ import annotations

from tests.host_check import run_host_check


def test_read_places_are_distinct_inside_their_parts_and_cover_every_edge(tmp_path):
    run_host_check("probe_places_check", tmp_path)
