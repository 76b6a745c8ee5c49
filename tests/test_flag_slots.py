"""The flag words (csrc/transports/pull.cuh P3), checked on the host: tests/flag_slots_check.cu is compiled with the
sources and run. A flag wait compares its word with its own call's counter for equality, which is exact only if
every (call parity, phase, source rank, CTA index) has a word of its own inside the flag area: the check fails when
two share a word, when one leaves the area, when part of the area is no flag's, and when the construction probe
misses either end of the area (which holds both parities).
"""

from __future__ import annotations

import os
import subprocess

from tests.test_build import _missing, _nvcc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_flag_has_a_word_of_its_own_inside_the_probed_area(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        _missing("nvcc not found (set CUDA_HOME)")
    binary = tmp_path / "flag_slots_check"
    source = os.path.join(ROOT, "tests", "flag_slots_check.cu")
    built = subprocess.run([nvcc, "-std=c++17", "-O1", "-arch=sm_90a", source, "-o", str(binary)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"nvcc {source}:\n{built.stderr[-3000:]}"
    ran = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "OK", ran.stdout[-3000:] + ran.stderr[-3000:]
