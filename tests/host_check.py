"""The tests' host-only C++ checks (tests/*_check.cu): each is one translation unit with the sources it checks, so
their internal helpers are in reach; it is built with nvcc and run. No GPU needed."""

from __future__ import annotations

import os
import subprocess

from tests.test_build import _missing, _nvcc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_host_check(name: str, tmp_path) -> str:
    """Build tests/<name>.cu into tmp_path; the binary's path."""
    nvcc = _nvcc()
    if nvcc is None:
        _missing("nvcc not found (set CUDA_HOME)")
    binary = tmp_path / name
    source = os.path.join(ROOT, "tests", f"{name}.cu")
    built = subprocess.run([nvcc, "-std=c++17", "-O1", "-arch=sm_90a", source, "-o", str(binary)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"nvcc {source}:\n{built.stderr[-3000:]}"
    return str(binary)


def run_host_check(name: str, tmp_path) -> None:
    """Build tests/<name>.cu and run it; fail with its output unless it prints exactly OK."""
    ran = subprocess.run([build_host_check(name, tmp_path)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "OK", ran.stdout[-3000:] + ran.stderr[-3000:]
