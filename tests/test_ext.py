"""Loading the compiled library (sgl_kernel_sm120/_ext.py, _abi.py): the one built for this torch, or a clear reason
and the command that builds it; and the ops it registers."""

from __future__ import annotations

import importlib.machinery

import pytest
import torch

import sgl_kernel_sm120 as k
from sgl_kernel_sm120 import _abi, _ext
from tests.support.env import spelled_out
from tests.test_build import _built_library

# Every op of csrc/torch_bindings.cpp. The product calls all but these, which serve the loopback benchmark
# (ws_create_loopback, ws_loopback_refill, fused_cluster_for: benchmarks/bench_transports.py), the one-process group
# of the tests and benchmarks (ws_link_local: benchmarks/harness/local_group.py), the doctor (cluster_capacity_for),
# a diagnostic script (ws_host_numa: scripts/diagnose_hostmem_create.py) and the tests' checks of agreed limits and
# clean scratch (ws_launch_limits, ws_dirty_halves: tests/gpu/harness.py).
OPS = {"ws_create", "ws_register_shared", "ws_link_local", "host_shared_bytes_for", "ws_host_numa",
       "cluster_capacity_for", "ws_cluster_capacity", "ws_set_launch_limits", "ws_launch_limits",
       "ws_probe_place_name", "debug_trap", "ws_create_loopback", "ws_loopback_refill", "ws_unlink_shared",
       "fused_cluster_for", "ws_ipc_handle", "ws_open_peers", "ws_close_peers", "ws_probe", "ws_destroy",
       "ws_error_record_address", "ws_slow_record_address", "ws_dirty_halves", "ws_calls_completed",
       "ws_check_context", "kernel_limits", "ws_sm_count", "all_reduce", "all_reduce_add_rmsnorm"}


def test_the_library_registers_exactly_the_ops_the_package_knows():
    _built_library()
    registered = {name.split("::", 1)[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("sgl_kernel_sm120::")}
    assert registered == OPS


def test_a_missing_extension_raises_with_the_build_command(monkeypatch):
    monkeypatch.setattr(_ext, "_load", lambda: (None, _ext.BUILD_HINT, ""))
    assert not k.kernels_available()
    with pytest.raises(k.KernelsNotBuiltError, match="pip install --no-build-isolation -e"):
        _ext.ops()


def test_a_library_for_another_torch_is_reported_as_that(tmp_path):
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / (_abi.extension_module("1.99.0+cu118", "11.8") + suffix)).write_bytes(b"")
    reason = _ext.missing_reason(str(tmp_path))
    assert "built for another torch (torch 1.99.0, CUDA 11.8)" in reason, reason
    assert f"this environment runs torch {torch.__version__.split('+')[0]}" in reason, reason
    assert "pip install --no-build-isolation -e" in reason, reason


def test_no_library_at_all_is_reported_as_not_built(tmp_path):
    reason = _ext.missing_reason(str(tmp_path))
    assert "are not built" in reason and _ext.expected_module() in reason, reason


def test_the_library_name_carries_torch_and_cuda():
    assert _abi.extension_module("2.14.1+cu130", "13.0") == "_C_torch2_14_1_cuda13_0"
    assert _abi.extension_module("2.11.0", "13.0") != _abi.extension_module("2.14.1", "13.0")
    assert _abi.describe_tag("_C_torch2_11_0_cuda13_0") == "torch 2.11.0, CUDA 13.0"


def test_a_library_override_that_fails_to_load_says_so(monkeypatch, tmp_path):
    # The negative-control builds are loaded through this switch; a bad path must be a clear error.
    for name in spelled_out("SGL_SM120_EXT_LIBRARY", ""):
        monkeypatch.setenv(name, str(tmp_path / "no_such_library.so"))
    _ext._load.cache_clear()
    try:
        assert not k.kernels_available()
        with pytest.raises(k.KernelsNotBuiltError, match="no_such_library.so .SGL_SM120_EXT_LIBRARY. failed"):
            _ext.ops()
    finally:
        monkeypatch.undo()
        _ext._load.cache_clear()
