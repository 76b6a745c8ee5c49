"""The construction probe's read places (csrc/probe.cu R1, R2), checked on the host: tests/probe_places_check.cu
is compiled with the sources and run, for 2, 4 and 8 ranks, with and without islands, at several sizes.

It fails when two readers (or two places of one reader) share a place, since the first to empty its pack would
make the other see only the fill on a healthy fabric; when a place leaves the part of the pull area it stands for;
when some first or last pack of a part (where pull's loads start and end) is loaded by nobody; and when the round
kinds are not the write rounds followed by one read round per parity.
"""

from __future__ import annotations

import os
import subprocess

from tests.test_build import _missing, _nvcc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_read_places_are_distinct_inside_their_parts_and_cover_every_edge(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        _missing("nvcc not found (set CUDA_HOME)")
    binary = tmp_path / "probe_places_check"
    source = os.path.join(ROOT, "tests", "probe_places_check.cu")
    built = subprocess.run([nvcc, "-std=c++17", "-O1", "-arch=sm_90a", source, "-o", str(binary)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"nvcc {source}:\n{built.stderr[-3000:]}"
    ran = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "OK", ran.stdout[-3000:] + ran.stderr[-3000:]
