"""The flag words (csrc/transports/pull.cuh P3), checked on the host: tests/flag_slots_check.cu is compiled with the
sources and run. A flag wait compares its word with its own call's counter for equality, which is exact only if
every (call parity, phase, source rank, CTA index) has a word of its own inside the flag area: the check fails when
two share a word, when one leaves the area, and when part of the area is no flag's. (tests/test_probe_places.py
checks that the construction probe reaches both ends of the area, which holds both parities.)
"""

from __future__ import annotations

from tests.host_check import run_host_check


def test_every_flag_has_a_word_of_its_own_inside_the_flag_area(tmp_path):
    run_host_check("flag_slots_check", tmp_path)
