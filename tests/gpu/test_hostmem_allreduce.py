"""GPU tests of IpcAllReduce(memory="host"): the workspace in shared pinned host memory (GPUs without P2P).

The same scenarios as tests/gpu/test_ipc_allreduce.py (exact integer sums and bitwise agreement across ranks,
special values, graph replays, back-to-back calls, create/close, a rank that skips a call, a dropped probe
write), run with the host-memory workspace: `SGL_SM120_TEST_MEMORY=host` in the environment the spawned ranks
inherit. On one GPU the ranks share it (SGL_SM120_TEST_SHARE_GPUS=1); the data path through host memory is
the same as on two GPUs.
"""

from __future__ import annotations

import glob

import pytest
import torch

from tests.gpu import test_ipc_allreduce as scenarios
from tests.gpu.harness import need_ranks, run_ranks

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def host_memory(monkeypatch):
    monkeypatch.setenv(scenarios.MEMORY_ENV, "host")
    before = set(glob.glob("/dev/shm/sgl_sm120_*"))
    yield
    left = set(glob.glob("/dev/shm/sgl_sm120_*")) - before
    assert not left, f"shared-memory names left behind: {sorted(left)}"


@need_ranks(2)
def test_hostmem_exact_sums_all_shapes_variants_dtypes():
    run_ranks(2, scenarios._scenario_exact_shapes, scenarios.ROWS, scenarios.HIDDENS, scenarios.DTYPES)


@need_ranks(2)
@pytest.mark.parametrize("world", [4, 8])
def test_hostmem_exact_sums_oversubscribed(world):
    run_ranks(world, scenarios._scenario_exact_shapes, [1, 3, 64], [7168, 8], [torch.bfloat16], 30.0, timeout_s=600)


@need_ranks(2)
def test_hostmem_special_values():
    run_ranks(2, scenarios._scenario_special_values)


@need_ranks(2)
def test_hostmem_back_to_back_calls():
    run_ranks(2, scenarios._scenario_back_to_back, 300)


@need_ranks(2)
def test_hostmem_graph_replays():
    run_ranks(2, scenarios._scenario_graph, 20, 50)


@need_ranks(2)
def test_hostmem_create_close_does_not_leak():
    run_ranks(2, scenarios._scenario_create_close, 30)


@need_ranks(2)
def test_hostmem_rank_skipping_a_call_ends_in_timeout_error_not_hang():
    run_ranks(2, scenarios._scenario_rank_skips_a_call, timeout_s=120)


@need_ranks(2)
def test_hostmem_probe_names_a_dropped_pair():
    run_ranks(2, scenarios._scenario_probe_drop)
