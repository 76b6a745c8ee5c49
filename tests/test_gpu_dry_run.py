"""The SGLang-level GPU tests that have a CPU dry run (SGL_SM120_TEST_DRY_RUN=1: SGLang's groups on gloo, the
kernels stood in by exact gloo sums; tests/gpu/sglang_harness.py) run here, so they follow the overlay and SGLang
on both stacks between GPU runs. What they check on a GPU (the kernels' bits, capture) stays for the GPU suite."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DRY_RUN_FILES = sorted(str(p) for p in (ROOT / "tests" / "gpu").glob("test_*.py")
                       if "\nDRY_RUN_OK = True" in p.read_text())


@pytest.mark.skipif(not DRY_RUN_FILES, reason="no GPU test declares a dry run")
def test_the_sglang_level_gpu_tests_pass_their_cpu_dry_run(tmp_path):
    pytest.importorskip("sglang")
    env = {**os.environ, "SGL_SM120_TEST_DRY_RUN": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           *DRY_RUN_FILES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " skipped" not in done.stdout.splitlines()[-1], tail
    left = sorted(p.name for p in tmp_path.iterdir() if "sm120" in p.name)  # the ranks' caches are removed
    assert left == [], left
