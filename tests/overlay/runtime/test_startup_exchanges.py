"""How many times a rank waits for its whole group during a server's start-up at 8 ranks: the backend's own
agreement rounds (gate, the workspace's outcome, routes) and the workspace's construction with its data-path probe
in device memory (sgl_kernel_sm120.IpcAllReduce, the library's ops stood in), every one of them an exchange over the
c10d store. Ranks are threads sharing an in-memory store; the exchange is counted where every round goes through it
(core/exchange.exchange). Each exchange is a wait for the slowest rank, so their number is start-up latency that
grows with nothing else a rank does."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
import torch.distributed as dist

from sgl_kernel_sm120 import _ext, policy
from sglang_sm120.core import exchange
from sglang_sm120.core.config import ByteBound
from sglang_sm120.runtime import backend as backend_mod
from tests.fake_ops import FakeOps
from tests.overlay.runtime.test_backend import _FlatTopology, fake_key_facts_of, make_backend, run_ranks
from tests.test_ipc_allreduce import LIMITS

WORLD = 8
MAX_EXCHANGES = 12


@pytest.fixture
def counted_exchanges(monkeypatch, tmp_path):
    """{rank: exchanges made}, with the kernel library's ops stood in and a CUDA device that needs no driver."""
    ops = FakeOps(world=WORLD)
    monkeypatch.setattr(_ext, "ops", lambda: ops)
    monkeypatch.setattr(policy, "kernel_limits", lambda: LIMITS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setenv("SGLANG_SM120_CACHE", str(tmp_path))
    monkeypatch.setenv("SGL_SM120_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(exchange, "VERDICT_GRACE_S", 0.5)
    monkeypatch.setattr(backend_mod, "probe", lambda uuids: _FlatTopology())

    def local_facts(device, mode):
        rank = int(threading.current_thread().name)
        return {"mode": mode, "node": "n0", "capability": [12, 0], "uuid": f"GPU-{rank}",
                "p2p": {f"GPU-{r}": True for r in range(WORLD)}, "kernel_error": None, "key": fake_key_facts_of(rank)}

    monkeypatch.setattr(backend_mod, "local_facts", local_facts)
    counts: collections.Counter = collections.Counter()
    real = exchange.exchange

    def counted(store, prefix, rank, world_size, payload, timeout_s):
        counts[rank] += 1
        return real(store, prefix, rank, world_size, payload, timeout_s)

    monkeypatch.setattr(exchange, "exchange", counted)
    yield counts
    assert not ops.live, "a workspace was left unfreed"


def test_a_rank_s_start_up_at_eight_ranks_takes_at_most_a_dozen_exchanges(counted_exchanges):
    store = dist.HashStore()

    def start(rank):
        backend = make_backend(rank, WORLD, store, timeout_s=10.0, name="tp:startup")
        backend.device = torch.device("cuda", 0)
        decision = backend.resolve_gate()
        built = backend.build(7168, torch.bfloat16, ByteBound(8 * 4 * 7168 * 2, "test"), tune="off")
        made = counted_exchanges[rank]
        backend.close()  # its unmapping barrier is shut-down, not start-up
        return decision.enabled, decision.memory, built, made

    results = run_ranks(WORLD, start, named=True)
    assert all(r[:3] == (True, "device", True) for r in results.values()), results
    # gate 2 (payloads, verdicts) + construction 4 (arguments, allocation, opening the peers, the probe) + the
    # workspace's outcome 2 + routes 2
    made = {r: result[3] for r, result in results.items()}
    assert set(made.values()) == {10} and max(made.values()) <= MAX_EXCHANGES, made
