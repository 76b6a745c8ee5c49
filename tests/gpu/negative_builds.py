"""The negative-control builds: the kernel sources compiled with one protocol invariant broken on purpose
(csrc/ar_protocol.cuh, csrc/transports/), each its own library. Nothing here imports pytest or torch, so a machine
without them can build the libraries ahead (scripts/device_lib.py build --negative, for a GPU machine's Python):

  python -m tests.gpu.negative_builds DIR     every broken library into DIR (the GPU suite runs it in the background)

SGL_SM120_NEGATIVE_BUILDS=DIR makes the tests load the libraries found there instead of compiling them."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREBUILT_ENV = "SGL_SM120_NEGATIVE_BUILDS"

FLAGS = ["SGL_SM120_DEBUG_NO_CLEAR", "SGL_SM120_DEBUG_SINGLE_BUFFER"]
STREAM_FLAG = "SGL_SM120_DEBUG_NO_STREAM_ORDER"
# The transports' own invariants (csrc/transports/): caught in the one-process concurrent mode
# (tests/gpu/test_transports.py), where the ranks' kernels really run at once.
TRANSPORT_FLAGS = ["SGL_SM120_DEBUG_FLAG_BEFORE_DATA", "SGL_SM120_DEBUG_STAGED_SKIP_PASS"]
ALL_FLAGS = [*FLAGS, STREAM_FLAG, *TRANSPORT_FLAGS]

BUILD = """
import glob, sys
from torch.utils.cpp_extension import load
root, name, flag, out = sys.argv[1:5]
sources = sorted(glob.glob(root + "/csrc/*.cu")) + sorted(glob.glob(root + "/csrc/*.cpp"))
load(name=name, sources=sources, extra_cflags=["-O2", "-D" + flag], extra_cuda_cflags=["-O3", "-D" + flag],
     extra_include_paths=[root + "/csrc"], build_directory=out, is_python_module=False, verbose=False)
"""


def build_broken(flag: str, out: str, python: str = sys.executable, env: dict | None = None) -> str:
    """The library broken by `flag` under out/<its name>/, built there by `python` unless one is already there."""
    # A subprocess: loading the library here would register the op namespace a second time next to `_C`.
    name = "sgl_sm120_" + flag.lower()
    out = os.path.join(out, name)  # one build folder per library: each holds its own build.ninja
    found = glob.glob(os.path.join(out, name + "*.so"))
    if not found:
        os.makedirs(out, exist_ok=True)
        subprocess.run([python, "-c", BUILD, ROOT, name, flag, out], check=True, timeout=900, env=env)
        found = glob.glob(os.path.join(out, name + "*.so"))
    (path,) = found
    return path


if __name__ == "__main__":
    import concurrent.futures

    target = sys.argv[1]
    os.makedirs(target, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(len(ALL_FLAGS)) as pool:
        for path in pool.map(lambda flag: build_broken(flag, target), ALL_FLAGS):
            print("built", path, flush=True)
