"""The construction probe's places and tags (csrc/probe.cu P1, P2), checked on the host: tests/probe_places_check.cu
is compiled with the sources and run, for 2, 4 and 8 ranks, with and without islands, at several sizes.

It fails when two senders, two readers, or a sender and a reader share a place in a rank's slab (the one round
could then not pass on a healthy fabric: one pack would overwrite or empty another), when a place leaves its page
or the scratch (the Ctrl head is never written), when the write pages are not every page from the Ctrl head to the
slab's end or the read pages do not start at the pull areas' first page (a page of the slab no probe reaches could
hold a broken mapping), when a tag reads as the empty fill or as a flag's zero, or two places share a tag (a
misrouted pack would then pass), and when a place is named for another area than its own.
"""

from __future__ import annotations

from tests.host_check import run_host_check


def test_places_are_distinct_cover_every_page_and_carry_distinct_tags(tmp_path):
    run_host_check("probe_places_check", tmp_path)
