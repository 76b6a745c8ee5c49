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

The broken builds take minutes; `python -m tests.gpu.test_negative_controls DIR` builds them ahead (the GPU suite
starts it in the background) and SGL_SM120_NEGATIVE_BUILDS=DIR makes the test use them.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

import pytest

from sgl_kernel_sm120.settings import VARIABLES
from tests.gpu.harness import need_ranks, run_ranks, shared_cluster_cache  # noqa: F401 - a fixture
from tests.gpu.test_ipc_allreduce import _scenario_graph, _scenario_two_streams_keep_the_call_order
from tests.support.env import spelled_out

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cluster_cache")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUILD = """
import glob, sys
from torch.utils.cpp_extension import load
root, name, flag, out = sys.argv[1:5]
sources = sorted(glob.glob(root + "/csrc/*.cu")) + sorted(glob.glob(root + "/csrc/*.cpp"))
load(name=name, sources=sources, extra_cflags=["-O2", "-D" + flag], extra_cuda_cflags=["-O3", "-D" + flag],
     extra_include_paths=[root + "/csrc"], build_directory=out, is_python_module=False, verbose=False)
"""


FLAGS = ["SGL_SM120_DEBUG_NO_CLEAR", "SGL_SM120_DEBUG_SINGLE_BUFFER"]
STREAM_FLAG = "SGL_SM120_DEBUG_NO_STREAM_ORDER"
# The transports' own invariants (csrc/transports/): caught in the one-process concurrent mode
# (tests/gpu/test_transports.py), where the ranks' kernels really run at once.
TRANSPORT_FLAGS = ["SGL_SM120_DEBUG_FLAG_BEFORE_DATA", "SGL_SM120_DEBUG_STAGED_SKIP_PASS"]
PREBUILT_ENV = "SGL_SM120_NEGATIVE_BUILDS"


def _build_broken(flag: str, out: str) -> str:
    # A subprocess: loading the library here would register the op namespace a second time next to `_C`.
    name = "sgl_sm120_" + flag.lower()
    out = os.path.join(out, name)  # one build folder per library: each holds its own build.ninja
    found = glob.glob(os.path.join(out, name + "*.so"))
    if not found:
        os.makedirs(out, exist_ok=True)
        subprocess.run([sys.executable, "-c", BUILD, ROOT, name, flag, out], check=True, timeout=900)
        found = glob.glob(os.path.join(out, name + "*.so"))
    (path,) = found
    return path


@need_ranks(2)
@pytest.mark.parametrize("flag", [*FLAGS, STREAM_FLAG])
def test_broken_protocol_is_caught(flag, monkeypatch):
    with tempfile.TemporaryDirectory() as scratch:
        library = _build_broken(flag, os.environ.get(PREBUILT_ENV) or scratch)
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


if __name__ == "__main__":
    # Build every broken library into DIR, in parallel (the GPU suite runs this in the background).
    import concurrent.futures

    target = sys.argv[1]
    os.makedirs(target, exist_ok=True)
    everything = FLAGS + [STREAM_FLAG] + TRANSPORT_FLAGS
    with concurrent.futures.ThreadPoolExecutor(len(everything)) as pool:
        for path in pool.map(lambda flag: _build_broken(flag, target), everything):
            print("built", path, flush=True)
