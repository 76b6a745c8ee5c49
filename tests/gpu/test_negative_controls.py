"""Protocol negative controls: the same sources built with one invariant of csrc/ar_protocol.cuh broken on
purpose must make the ordinary checks fail. A suite that passed these builds would prove nothing.

  SGL_SM120_DEBUG_NO_CLEAR       consumers leave scratch dirty (breaks I4): later calls read stale packs
  SGL_SM120_DEBUG_SINGLE_BUFFER  one scratch buffer instead of two (breaks I5): a rank that runs ahead
                                 overwrites, or has cleared, packs its peer has not consumed yet
  SGL_SM120_DEBUG_NO_STREAM_ORDER a call from another stream is not ordered after the previous one (breaks I6):
                                 calls from two streams overtake each other on one rank and pair with the wrong
                                 calls of its peer (its own scenario: calls alternating between two streams)

Each build is loaded in the spawned ranks instead of the packaged `_C` (SGL_SM120_EXT_LIBRARY), and runs a CUDA
graph of mixed calls (sizes, plain and fused, every schedule) replayed many times, with a short spin bound and the
timeout in exit mode (a timeout is then a clean record, not a trap), so a broken protocol ends in a wrong result
or a timeout error, never a hang. A graph rather than eager calls: with ranks time-slicing one GPU, a rank runs
many captured calls in one time slice, and only then does a rank get a whole call ahead of its peer, which is
what a broken double buffer needs to show (the eager back-to-back scenario let SINGLE_BUFFER pass on one GPU).

The broken builds take minutes: tests/gpu/negative_builds.py builds them ahead.
"""

from __future__ import annotations

import os
import tempfile

import pytest

from sgl_kernel_sm120.settings import VARIABLES
from tests.gpu.harness import need_ranks, run_ranks, shared_cluster_cache  # noqa: F401 - a fixture
from tests.gpu.negative_builds import FLAGS, PREBUILT_ENV, STREAM_FLAG, build_broken
from tests.gpu.test_ipc_allreduce import _scenario_graph, _scenario_two_streams_keep_the_call_order
from tests.support.env import spelled_out

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cluster_cache")]


@need_ranks(2)
@pytest.mark.parametrize("flag", [*FLAGS, STREAM_FLAG])
def test_broken_protocol_is_caught(flag, monkeypatch):
    with tempfile.TemporaryDirectory() as scratch:
        library = build_broken(flag, os.environ.get(PREBUILT_ENV) or scratch)
        for name, value in {**spelled_out(VARIABLES["library"], library),
                            **spelled_out(VARIABLES["timeout_s"], "2")}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(AssertionError) as caught:
            if flag == STREAM_FLAG:
                run_ranks(2, _scenario_two_streams_keep_the_call_order, timeout_s=300)
            else:
                run_ranks(2, _scenario_graph, 24, 100, "exit", timeout_s=300)
    report = str(caught.value)
    assert "wrong" in report or "timed out" in report or "scratch not clean" in report, report[-2000:]
