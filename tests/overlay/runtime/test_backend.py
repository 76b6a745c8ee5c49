"""The backend's collective steps (gate agreement, workspace build) and its dispatch rule, on CPU: ranks are
threads sharing an in-memory c10d store; the kernel workspace is a fake."""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist

from sglang_sm120.core import exchange
from sglang_sm120.core.config import ByteBound, OverlaySettings
from sglang_sm120.core.facts import group_facts
from sglang_sm120.core.gate import GateDecision
from sglang_sm120.runtime import backend as backend_mod
from tests.support.fakes import FakeIpcAllReduce


@pytest.fixture(autouse=True)
def short_timeouts(monkeypatch):
    monkeypatch.setattr(exchange, "VERDICT_GRACE_S", 0.5)


_names = itertools.count()


def make_backend(rank, world, store, mode="auto", timeout_s=0.5, name=None, hostmem="auto"):
    # Exchange keys are counted per (group name, rank): a fresh name per test keeps the ranks in step.
    return backend_mod.TPBackend(
        name=name or f"tp:{next(_names)}", ranks=list(range(world)), rank_in_group=rank, world_size=world,
        device=torch.device("cpu"), deterministic=False, store=store,
        settings=OverlaySettings(mode=mode, hostmem=hostmem, agreement_timeout_s=timeout_s),
    )


def reduce(backend, x):
    """A plain call as the hook makes it: checked once (route_for), then run."""
    route = backend.route_for(x)
    assert route is not None, "the backend does not take this call"
    return backend.run(x, route)


def run_ranks(world, target, named=False):
    """target(rank) on one thread per rank; {rank: result}. Fails when a rank raised or did not finish, so a test
    never judges from the ranks that happened to return. `named`: each thread is named after its rank (the
    fakes that stand for a rank's own GPU read it; unnamed, every rank looks like rank 0 to fake_key_facts)."""
    results, errors = {}, {}

    def body(rank):
        try:
            results[rank] = target(rank)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), name=str(r) if named else None) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert sorted(results) == list(range(world)), f"ranks that finished: {sorted(results)}"
    return results


def synthetic_facts(capability, node="n0", p2p_ok=True, world=2):
    def local_facts(device, mode):
        uuids = [f"GPU-{i}" for i in range(world)]
        return {"mode": mode, "node": node, "capability": list(capability), "uuid": None,
                "p2p": {u: p2p_ok for u in uuids}, "kernel_error": None}

    return local_facts


def test_exchange_and_agreement_all_present():
    store = dist.HashStore()
    out = run_ranks(3, lambda r: exchange.agree(store, "t", r, 3, {"r": r}, 2.0))
    assert all(v == [{"r": 0}, {"r": 1}, {"r": 2}] for v in out.values())


def test_agreement_fails_on_every_present_rank_when_one_never_shows_up():
    store = dist.HashStore()

    def attempt(rank):
        with pytest.raises(exchange.AgreementFailed, match=r"\[2\]"):
            exchange.agree(store, "t", rank, 3, {"r": rank}, 0.3)
        return True

    assert run_ranks(2, attempt) == {0: True, 1: True}


def test_group_facts_p2p_matrix_by_uuid():
    facts = [
        {"mode": "auto", "node": "a", "capability": [12, 0], "uuid": "GPU-a", "p2p": {"GPU-a": True, "GPU-b": True}},
        {"mode": "auto", "node": "a", "capability": [12, 0], "uuid": "GPU-b", "p2p": {"GPU-a": False, "GPU-b": True}},
    ]
    gathered = group_facts(facts)
    assert gathered.p2p == [[True, True], [False, True]]
    assert gathered.nnodes == 1 and gathered.capabilities == [(12, 0), (12, 0)]
    facts[1]["node"] = "b"
    assert group_facts(facts).nnodes == 2


def test_gate_resolves_identically_on_every_rank(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setattr(backend_mod, "local_facts", synthetic_facts((12, 1)))
    decisions = run_ranks(2, lambda r: make_backend(r, 2, store, name="tp:same").resolve_gate())
    assert decisions[0] == decisions[1]
    assert not decisions[0].enabled and "12.1" in decisions[0].reason


def test_gate_enabled_with_full_facts(monkeypatch):
    store = dist.HashStore()

    def local_facts(device, mode):
        rank = int(threading.current_thread().name)
        return {"mode": mode, "node": "n0", "capability": [12, 0], "uuid": f"GPU-{rank}",
                "p2p": {"GPU-0": True, "GPU-1": True}, "kernel_error": None}

    monkeypatch.setattr(backend_mod, "local_facts", local_facts)
    results = {}

    def body(rank):
        results[rank] = make_backend(rank, 2, store, name="tp:full").resolve_gate()

    run_ranks(2, body, named=True)
    assert results[0] == results[1] and results[0].enabled, results


def test_gate_times_out_to_nccl_when_a_peer_is_unpatched(monkeypatch):
    monkeypatch.setattr(backend_mod, "local_facts", synthetic_facts((12, 0)))
    backend = make_backend(0, 2, dist.HashStore(), timeout_s=0.2)
    decision = backend.resolve_gate()
    assert not decision.enabled
    assert "agreement failed" in decision.reason and "NCCL" in decision.reason


def test_gate_without_store_falls_back(monkeypatch):
    monkeypatch.setattr(backend_mod, "local_facts", synthetic_facts((12, 0)))
    backend = make_backend(0, 2, None)
    assert not backend.resolve_gate().enabled


@pytest.fixture
def fake_kernel_module(monkeypatch):
    module = types.ModuleType("sgl_kernel_sm120")
    FakeIpcAllReduce.instances.clear()
    module.IpcAllReduce = FakeIpcAllReduce
    monkeypatch.setitem(sys.modules, "sgl_kernel_sm120", module)
    monkeypatch.setattr(backend_mod, "probe", lambda uuids: _FlatTopology())
    return module


def fake_key_facts_of(rank):
    return {"uuid": f"GPU-{rank}", "pci_bus_id": f"00000000:0{rank}:00.0", "name": "fake", "driver": "580.1",
            "cuda": "13.0", "torch": "2.14.1", "nccl": "2.27.3", "nccl_settings": {}, "sglang_sm120": "0.1.0",
            "kernels": "fake"}


class _FlatTopology:
    link = "pcie"
    levels = None
    numa_nodes = []
    error = None

    def islands(self):
        return None


def enabled_backend(rank, world, store, name, memory="device", hostmem="auto"):
    """A backend whose gate round passed: every rank's facts as the gate gathered them."""
    backend = make_backend(rank, world, store, timeout_s=2.0, name=name, hostmem=hostmem)
    backend.decision = GateDecision(True, "test", memory=memory)
    backend.facts = group_facts([{"mode": "auto", "node": "n0", "capability": [12, 0], "uuid": f"GPU-{r}",
                                  "p2p": {f"GPU-{i}": memory == "device" or i == r for i in range(world)},
                                  "key": fake_key_facts_of(r)} for r in range(world)])
    return backend


def test_build_sizes_workspace_and_dispatch_bound(fake_kernel_module):
    store = dist.HashStore()
    bound = ByteBound(8 * 4 * 7168 * 2, "test")
    def build(rank):
        backend = enabled_backend(rank, 2, store, "tp:build")
        backend.build(7168, torch.bfloat16, bound)
        return backend

    backends = run_ranks(2, build)
    for backend in backends.values():
        assert backend.active
        assert backend.workspace.max_numel == 8 * 4 * 7168
        assert backend.max_bytes == bound.max_bytes
        assert backend.max_fused_tokens == 32
        assert backend.link == "pcie"
        small = torch.zeros(3, 7168, dtype=torch.bfloat16)
        edge = torch.zeros(32, 7168, dtype=torch.bfloat16)
        large = torch.zeros(33, 7168, dtype=torch.bfloat16)
        assert backend.route_for(small) and backend.route_for(edge) and not backend.route_for(large)
        assert not backend.route_for(torch.zeros(3, 7168, dtype=torch.float32))  # kernel declines fp32
        assert not backend.route_for(torch.zeros(7168, 3, dtype=torch.bfloat16).t())  # non-contiguous
        weight = torch.ones(7168, dtype=torch.bfloat16)
        assert backend.fused_route_for(small, small.clone(), weight)
        assert not backend.fused_route_for(large, large.clone(), weight)
        assert not backend.fused_route_for(small, small.float(), weight)
        assert not backend.fused_route_for(small, small.clone(), weight.float())
        # built once: a second build (the draft runner's) keeps the first workspace
        first = backend.workspace
        assert backend.build(4096, torch.bfloat16, ByteBound(1 << 20, "again"))
        assert backend.workspace is first
        backend.close()
        assert not backend.active and first.closed


def test_build_failure_on_one_rank_disables_every_rank(fake_kernel_module):
    store = dist.HashStore()

    class FailsOnRank1(FakeIpcAllReduce):
        def __init__(self, *args, **kwargs):
            if threading.current_thread().name == "1":
                raise RuntimeError("cudaIpcOpenMemHandle failed")
            super().__init__(*args, **kwargs)

    fake_kernel_module.IpcAllReduce = FailsOnRank1
    results = {}

    def body(rank):
        backend = enabled_backend(rank, 2, store, "tp:fail")
        backend.build(7168, torch.bfloat16, ByteBound(1 << 16, "t"))
        results[rank] = backend

    run_ranks(2, body, named=True)
    assert sorted(results) == [0, 1]
    for backend in results.values():
        assert not backend.active
        assert "rank 1" in backend.build_error and "cudaIpcOpenMemHandle" in backend.build_error
    assert all(inst.closed for inst in FakeIpcAllReduce.instances)


def test_build_refuses_unsupported_dtype(fake_kernel_module):
    backend = enabled_backend(0, 1, dist.HashStore(), "tp:dtype")
    assert not backend.build(7168, torch.float32, ByteBound(1 << 16, "t"))
    assert "float32" in backend.build_error


def test_build_skipped_when_gate_disabled(fake_kernel_module):
    backend = make_backend(0, 2, dist.HashStore())
    backend.decision = GateDecision(False, "no")
    assert not backend.build(7168, torch.bfloat16, ByteBound(1 << 16, "t"))
    assert not FakeIpcAllReduce.instances


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "sglang_sm120"]


def test_activation_is_one_warning_line_with_bound_schedule_and_islands(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    store = dist.HashStore()
    bound = ByteBound(8 * 4 * 7168 * 2, "max CUDA-graph batch 8 x 4 token(s) per request")
    backends = run_ranks(2, lambda r: (lambda b: (b.build(7168, torch.bfloat16, bound), b)[1])(
        enabled_backend(r, 2, store, "tp:line")))
    lines = _warnings(caplog)
    assert len(lines) == 1, lines  # rank 0 only, once
    line = lines[0]
    assert "sm120 IPC all-reduce ENABLED for TP group tp:line (2 ranks, mode auto)" in line, line
    assert f"up to {bound.max_bytes} B" in line and f"ONESHOT up to {bound.max_bytes} B" in line, line
    assert "32 tokens x 7168" in line and "islands none (flat)" in line and "link pcie" in line, line
    assert "max CUDA-graph batch 8" in line, line
    # the counter the server info reports: calls as the workspace counted them
    backend = backends[0]
    reduce(backend, torch.ones(2, 8, dtype=torch.bfloat16))
    assert backend.describe()["device_calls"] == 1
    backend.close()
    assert backend.describe()["device_calls"] is None


def test_disabled_gate_is_one_warning_line_with_the_reason(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    store = dist.HashStore()
    monkeypatch.setattr(backend_mod, "local_facts", synthetic_facts((9, 0)))
    run_ranks(2, lambda r: make_backend(r, 2, store, name="tp:off").resolve_gate())
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert "sm120 IPC all-reduce DISABLED for TP group tp:off (2 ranks, mode auto)" in lines[0], lines
    assert "compute capability 12.0" in lines[0] and "SGLang's own all-reduce paths are used" in lines[0], lines


def test_failed_build_is_one_disabled_warning_line(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    backend = enabled_backend(0, 1, dist.HashStore(), "tp:dtype-line")
    assert not backend.build(7168, torch.float32, ByteBound(1 << 16, "t"))
    lines = _warnings(caplog)
    assert len(lines) == 1 and "DISABLED" in lines[0] and "float32" in lines[0], lines


def test_mode_off_is_one_disabled_warning_line(monkeypatch, caplog):
    from sglang_sm120.core import config
    from sglang_sm120.hooks import distributed as hooks_distributed

    caplog.set_level(logging.INFO, logger="sglang_sm120")
    monkeypatch.setenv(config.MODE_ENV, "off")
    monkeypatch.setattr(hooks_distributed, "runtime_server_args", lambda: None)
    group = types.SimpleNamespace(unique_name="tp:0", world_size=2, rank_in_group=0, device=torch.device("cuda", 0))
    assert hooks_distributed.attach(group) is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "DISABLED for TP group tp:0 (2 ranks, mode off)" in lines[0], lines


def test_server_info_reports_state_and_device_counter(fake_kernel_module, monkeypatch):
    from sglang_sm120.hooks import distributed as hooks_distributed
    from sglang_sm120.hooks import server_info as hooks_server_info

    backend = enabled_backend(0, 1, dist.HashStore(), "tp:info")
    assert backend.build(7168, torch.bfloat16, ByteBound(1 << 16, "t"))
    for _ in range(3):
        reduce(backend, torch.ones(2, 8, dtype=torch.bfloat16))
    output = types.SimpleNamespace(internal_state={"last_gen_throughput": 1.0})
    report = hooks_server_info.wrap_get_internal_state(lambda self, req: output)

    monkeypatch.setattr(hooks_distributed, "tp_backend", lambda: backend)
    monkeypatch.setattr(hooks_server_info, "tp_backend", lambda: backend)
    state = report(object(), object()).internal_state
    assert state["last_gen_throughput"] == 1.0
    ours = state[hooks_server_info.STATE_KEY]
    assert ours["active"] and ours["device_calls"] == 3 and ours["stats"]["sm120"] == 3, ours
    import json

    json.dumps(state)  # the server sends it as JSON

    monkeypatch.setattr(hooks_server_info, "tp_backend", lambda: None)
    state = report(object(), object()).internal_state
    assert state[hooks_server_info.STATE_KEY]["active"] is False


def test_activation_line_says_when_sglangs_own_pcie_allreduce_was_requested_too(fake_kernel_module, monkeypatch,
                                                                                  caplog):
    from sglang_sm120.hooks import upstream_pcie

    caplog.set_level(logging.INFO, logger="sglang_sm120")
    monkeypatch.setattr(upstream_pcie, "upstream_pcie_ipc_requested", lambda: True)
    backend = enabled_backend(0, 1, dist.HashStore(), "tp:coexist")
    backend.upstream_note = upstream_pcie.activation_note  # what hooks/distributed.attach gives every backend
    assert backend.build(7168, torch.bfloat16, ByteBound(1 << 16, "t"))
    line = _warnings(caplog)[-1]
    assert "ENABLED" in line and "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE is set too" in line, line
    assert "PCIe-IPC workspace is not built" in line, line
    line = backend_mod.activation_line
    assert line(False, "tp:0", 8, "auto", "no P2P", upstream_pcie.activation_note(False)).endswith(
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE is set: SGLang's own PCIe-IPC all-reduce is used")
    monkeypatch.setattr(upstream_pcie, "upstream_pcie_ipc_requested", lambda: False)
    assert line(False, "tp:0", 8, "auto", "no P2P", upstream_pcie.activation_note(False)).endswith(
        "SGLang's own all-reduce paths are used")


# --- the host-memory workspace (no CUDA P2P) ------------------------------------------------------------------


@pytest.mark.parametrize("hostmem,enabled", [("auto", True), ("off", False)])
def test_gate_without_p2p_selects_host_memory_unless_refused(monkeypatch, hostmem, enabled):
    store = dist.HashStore()
    results = {}

    def body(rank):
        backend = make_backend(rank, 2, store, name=f"tp:nop2p-{hostmem}", hostmem=hostmem)
        results[rank] = (backend.resolve_gate(), backend)

    def local_facts(device, mode):  # two GeForce cards that cannot reach each other
        rank = int(threading.current_thread().name)
        return {"mode": mode, "node": "n0", "capability": [12, 0], "uuid": f"GPU-{rank}",
                "name": "NVIDIA GeForce RTX 5090", "p2p": {f"GPU-{rank}": True, f"GPU-{1 - rank}": False},
                "kernel_error": None}

    monkeypatch.setattr(backend_mod, "local_facts", local_facts)
    run_ranks(2, body, named=True)
    (d0, b0), (d1, _) = results[0], results[1]
    assert d0 == d1 and d0.enabled is enabled, d0
    assert "GeForce" in d0.reason and "0->1" in d0.reason, d0.reason
    if enabled:
        assert d0.memory == "host" and b0.memory == "host" and b0.describe()["memory"] == "host"
    else:
        assert "SGLANG_SM120_HOSTMEM=off" in d0.reason and b0.memory is None


def test_host_memory_decision_builds_a_host_workspace_without_islands(fake_kernel_module, caplog, monkeypatch):
    from sglang_sm120.hooks import distributed as hooks_distributed
    from sglang_sm120.hooks import server_info as hooks_server_info

    caplog.set_level(logging.INFO, logger="sglang_sm120")
    store = dist.HashStore()
    probed = []
    monkeypatch.setattr(backend_mod, "probe", lambda uuids: probed.append(uuids) or _FlatTopology())
    bound = ByteBound(4 * 7168 * 2, "t")
    backends = run_ranks(2, lambda r: (lambda b: (b.build(7168, torch.bfloat16, bound), b)[1])(
        enabled_backend(r, 2, store, "tp:host", memory="host")))
    for backend in backends.values():
        assert backend.active and backend.memory == "host", backend.build_error
        assert backend.workspace.memory == "host" and backend.workspace.islands is None
        assert backend.link == "host" and backend.islands is None
    assert not probed  # no topology probe for a host workspace
    lines = _warnings(caplog)
    assert len(lines) == 1 and "ENABLED" in lines[0], lines
    assert "transport: pinned host memory (no P2P)" in lines[0] and "link host" in lines[0], lines[0]
    assert "islands none (flat)" in lines[0], lines[0]
    monkeypatch.setattr(hooks_server_info, "tp_backend", lambda: backends[0])
    monkeypatch.setattr(hooks_distributed, "tp_backend", lambda: backends[0])
    assert hooks_server_info.sm120_state()["memory"] == "host"


def test_device_memory_decision_passes_memory_device_and_says_cuda_ipc(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    backend = enabled_backend(0, 1, dist.HashStore(), "tp:device")
    assert backend.build(7168, torch.bfloat16, ByteBound(1 << 16, "t"))
    assert backend.workspace.memory == "device" and backend.memory == "device"
    assert backend.describe()["memory"] == "device"
    assert "transport: CUDA IPC (P2P)" in _warnings(caplog)[-1]


def _build_all(world, store, name, **kwargs):
    results = {}

    def body(rank):
        backend = enabled_backend(rank, world, store, name, **kwargs)
        backend.build(7168, torch.bfloat16, ByteBound(1 << 16, "t"))
        results[rank] = backend

    run_ranks(world, body, named=True)
    assert sorted(results) == list(range(world)), sorted(results)
    return results


def test_probe_failure_retries_once_in_host_memory(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    fake = FakeIpcAllReduce.failing(probe_pairs=[(1, 0, "dropped")])
    fake_kernel_module.IpcAllReduce = fake
    backends = _build_all(2, dist.HashStore(), "tp:retry")
    assert sorted(fake.attempts) == ["device", "device", "host", "host"], fake.attempts
    for backend in backends.values():
        assert backend.active and backend.memory == "host" and backend.workspace.memory == "host", backend.build_error
        assert backend.workspace.islands is None and backend.link == "host"
        assert backend.describe()["memory"] == "host"
        assert "rank 1 -> rank 0" in backend.describe()["memory_note"]
    lines = _warnings(caplog)
    assert len(lines) == 2, lines  # rank 0 only: the retry, then the ENABLED line
    assert "P2P data-path probe failed for rank 1 -> rank 0 (dropped)" in lines[0], lines[0]
    assert "host-memory workspace (no P2P needed) is used instead" in lines[0], lines[0]
    assert "ENABLED" in lines[1] and "transport: pinned host memory (no P2P), because the CUDA P2P data-path probe " \
        "failed for rank 1 -> rank 0" in lines[1], lines[1]


def test_probe_failure_and_failed_host_retry_give_up_with_both_reasons(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    fake = FakeIpcAllReduce.failing(probe_pairs=[(0, 1, "wrong data")], host_error="shm_open failed")
    fake_kernel_module.IpcAllReduce = fake
    backends = _build_all(2, dist.HashStore(), "tp:retry-fails")
    assert sorted(fake.attempts) == ["device", "device", "host", "host"], fake.attempts
    for backend in backends.values():
        assert not backend.active and backend.memory is None
        assert "IpcAllReduceProbeError" in backend.build_error and "shm_open failed" in backend.build_error
        assert backend.describe()["memory"] is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "DISABLED" in lines[0], lines
    assert "rank 0 -> rank 1" in lines[0] and "retry in pinned host memory failed too" in lines[0], lines[0]


def test_probe_failure_with_hostmem_off_stays_on_nccl(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    fake = FakeIpcAllReduce.failing()
    fake_kernel_module.IpcAllReduce = fake
    backends = _build_all(2, dist.HashStore(), "tp:retry-off", hostmem="off")
    assert fake.attempts == ["device", "device"]
    for backend in backends.values():
        assert not backend.active
        assert "IpcAllReduceProbeError" in backend.build_error and "SGLANG_SM120_HOSTMEM=off" in backend.build_error
    lines = _warnings(caplog)
    assert len(lines) == 1 and "DISABLED" in lines[0] and "rank 1 -> rank 0" in lines[0], lines


def test_other_build_failures_are_not_retried_in_host_memory(fake_kernel_module):
    class Fails(FakeIpcAllReduce.failing(probe_pairs=None)):
        def __init__(self, *args, **kwargs):
            type(self).attempts.append(kwargs.get("memory"))
            raise RuntimeError("cudaIpcOpenMemHandle failed")

    Fails.attempts = []
    fake_kernel_module.IpcAllReduce = Fails
    backends = _build_all(2, dist.HashStore(), "tp:no-retry")
    assert Fails.attempts == ["device", "device"]
    assert all(not b.active and "cudaIpcOpenMemHandle" in b.build_error for b in backends.values())


def test_host_workspace_failure_is_not_retried(fake_kernel_module):
    fake = FakeIpcAllReduce.failing(probe_pairs=None, host_error="no shared memory")
    fake_kernel_module.IpcAllReduce = fake
    backends = _build_all(2, dist.HashStore(), "tp:host-fails", memory="host")
    assert fake.attempts == ["host", "host"]
    assert all(not b.active and "no shared memory" in b.build_error for b in backends.values())


def test_host_workspace_that_does_not_fit_its_tmpfs_names_the_folder_and_sizes(fake_kernel_module, caplog):
    """A small /dev/shm (64 MiB in Docker and Kubernetes) leaves the group on NCCL with one line
    that names the folder, its free space and the size needed, not a SIGBUS. The sentence travels as the error's
    attribute, so its words do not decide anything."""
    from sgl_kernel_sm120.errors import IpcAllReduceHostMemoryError

    caplog.set_level(logging.INFO, logger="sglang_sm120")
    sentence = ("/dev/shm has 60.0 MiB free, the workspace needs 112.0 MiB (8 slabs of 14.0 MiB); "
                "enlarge it (docker run --shm-size=1g) or point SGL_SM120_SHM_DIR at a larger tmpfs")
    fake = FakeIpcAllReduce.failing(probe_pairs=None, host_error=f"IpcAllReduce argument check failed (rank 0: "
                                    f"IpcAllReduceHostMemoryError: {sentence})",
                                    host_error_type=functools.partial(IpcAllReduceHostMemoryError, tmpfs=sentence))
    fake_kernel_module.IpcAllReduce = fake
    backends = _build_all(2, dist.HashStore(), "tp:shm-small", memory="host")
    assert fake.attempts == ["host", "host"]
    for backend in backends.values():
        assert not backend.active
        assert backend.build_error == f"the pinned host-memory workspace does not fit: {sentence}", backend.build_error
    lines = _warnings(caplog)
    assert len(lines) == 1 and "DISABLED" in lines[0] and sentence in lines[0], lines
    assert "all-reduce paths are used" in lines[0], lines[0]


def test_activation_line_says_how_the_fused_op_spreads_a_few_rows(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    backend = enabled_backend(0, 1, dist.HashStore(), "tp:clusters")
    assert backend.build(7168, torch.bfloat16, ByteBound(1 << 16, "t"))
    assert "a few rows over 8/4/2-CTA clusters" in _warnings(caplog)[-1], _warnings(caplog)[-1]
    assert backend.describe()["fused_clusters"]["clusters"] == [8, 4, 2]


def test_attach_reads_the_hostmem_setting(monkeypatch):
    from sglang_sm120.core import config
    from sglang_sm120.hooks import distributed as hooks_distributed
    from sglang_sm120.hooks import upstream_pcie

    monkeypatch.setenv(config.HOSTMEM_ENV, "off")
    monkeypatch.setattr(hooks_distributed, "runtime_server_args", lambda: None)
    monkeypatch.setattr(hooks_distributed, "default_store", lambda: None)

    class Group:  # the backend keeps a weak reference to its GroupCoordinator
        unique_name, world_size, rank_in_group, ranks = "tp:0", 2, 1, [0, 1]
        device = torch.device("cuda", 0)

    backend = hooks_distributed.attach(Group())
    assert backend is not None and backend.settings.hostmem == "off"
    assert backend.upstream_note is upstream_pcie.activation_note


# ---------------------------------------------------------------------------------------------------------
# routing by a table


def _table_for_the_fake_group(plain_ours_rows, fused_ours_rows, rows=32, **key_changes):
    from sglang_sm120.core.facts import launch_facts
    from sglang_sm120.routing import cache
    from sglang_sm120.routing.table import NCCL, Point, RoutingTable, make_key

    key = make_key([{**fake_key_facts_of(0), **key_changes}, {**fake_key_facts_of(1), **key_changes}],
                   islands=None, p2p=[[True, True], [True, True]], memory="device",
                   launch=launch_facts(FakeIpcAllReduce))

    def points(ours_rows, cid):
        return [Point(r, r * 7168 * 2, {NCCL: 20.0, cid: 10.0 if r <= ours_rows else 30.0})
                for r in range(1, rows + 1)]

    table = RoutingTable.from_points(
        key=key, measured="2026-12-03T10:00:00Z", workload={"hidden": 7168, "max_bytes": rows * 7168 * 2},
        measurements={("bfloat16", "plain"): points(plain_ours_rows, "sm120/TWOSHOT/push/device"),
                      ("bfloat16", "fused"): points(fused_ours_rows, "sm120/ONESHOT/push/device/c4")})
    return cache.save(table)


def _built(world, store, name, bound, **build):
    return run_ranks(world, lambda r: (lambda b: (b.build(7168, torch.bfloat16, bound, **build), b)[1])(
        enabled_backend(r, world, store, name)))


def test_a_tuned_table_routes_each_size_and_the_line_names_it_with_nccl_at_the_verify_size(fake_kernel_module,
                                                                                             caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    path = _table_for_the_fake_group(plain_ours_rows=4, fused_ours_rows=2)
    backends = _built(2, dist.HashStore(), "tp:tabled", ByteBound(32 * 7168 * 2, "32 rows"), tune="auto",
                      verify_rows=2)
    line = _warnings(caplog)[-1]
    assert f"routes: tuned table {path}, measured 2026-12-03T10:00:00Z" in line, line
    assert "where the table routes them, plain: TWOSHOT/push/device up to 57344 B, NCCL up to 458752 B; fused: " \
           "ONESHOT/push/device/c4 up to 28672 B, NCCL up to 458752 B" in line, line
    assert "at the verify size [2, 7168] bfloat16: fused: ours 10.0 us (ONESHOT/push/device/c4) against NCCL " \
           "20.0 us, plain: ours 10.0 us (TWOSHOT/push/device) against NCCL 20.0 us" in line, line
    backend = backends[0]
    weight = torch.ones(7168, dtype=torch.bfloat16)
    four, five = torch.ones(4, 7168, dtype=torch.bfloat16), torch.ones(5, 7168, dtype=torch.bfloat16)
    assert backend.route_for(four) and not backend.route_for(five)  # NCCL won from 5 rows on
    two, three = four[:2].contiguous(), four[:3].contiguous()
    assert backend.fused_route_for(two, two.clone(), weight) and not backend.fused_route_for(three, three.clone(),
                                                                                            weight)
    assert backend.fused_tokens == frozenset({1, 2})
    reduce(backend, four)
    residual = two.clone()
    backend.run_fused(two, residual, weight, 1e-6, backend.fused_route_for(two, residual, weight))
    # the routes run resolved: every launch field the op needs is named
    assert [r.id for r in backend.workspace.routes_run] == ["TWOSHOT/push/device/b188/t64",
                                                           "ONESHOT/push/device/b188/c4"]
    assert backend.describe()["routes"]["source"] == "table"
    for b in backends.values():
        b.close()


def test_a_table_measured_against_another_nccl_configuration_is_not_used(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    _table_for_the_fake_group(plain_ours_rows=4, fused_ours_rows=2, nccl_settings={"NCCL_P2P_LEVEL": "SYS"})
    backends = _built(2, dist.HashStore(), "tp:other-nccl", ByteBound(8 * 7168 * 2, "t"), tune="auto")
    line = _warnings(caplog)[-1]
    assert "ALL SIZES ON NCCL" in line and "other versions (nccl_settings {'NCCL_P2P_LEVEL': 'SYS'} -> {}" in line, \
        line
    assert not backends[0].route_for(torch.ones(2, 7168, dtype=torch.bfloat16))


def test_without_a_table_tune_off_routes_by_the_seeds_and_says_so(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    backends = _built(2, dist.HashStore(), "tp:seeded", ByteBound(8 * 7168 * 2, "t"), tune="off")
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert lines[0].endswith("routes: seeds, UNMEASURED on this box: every size within the bound goes to the "
                             "sm120 kernels (--sm120-allreduce-tune off; python -m sglang_sm120.tune measures this "
                             "box)"), lines
    backend = backends[0]
    assert backend.route_for(torch.ones(8, 7168, dtype=torch.bfloat16)) and 8 in backend.fused_tokens
    reduce(backend, torch.ones(8, 7168, dtype=torch.bfloat16))
    assert [r.id for r in backend.workspace.routes_run] == ["ONESHOT/push/device/b188/t128"]  # the seed, resolved
    routes = backend.describe()["routes"]
    assert routes["source"] == "seeds" and routes["why"].startswith("no routing table of this box")


def test_without_a_table_tune_auto_sends_every_size_to_nccl_closes_its_workspace_and_names_the_command(
        fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    backends = _built(2, dist.HashStore(), "tp:nccl", ByteBound(8 * 7168 * 2, "t"), tune="auto")
    line = _warnings(caplog)[-1]
    assert "sm120 IPC all-reduce ALL SIZES ON NCCL for TP group tp:nccl" in line, line
    assert "routes: all NCCL because no routing table of this box" in line, line
    assert "the launcher's tune gives one" in line and "python -m sglang_sm120.tune" in line, line
    for backend in backends.values():
        assert not backend.active and backend.workspace is None
        assert not backend.route_for(torch.ones(8, 7168, dtype=torch.bfloat16)) and not backend.fused_tokens
        info = backend.describe()
        assert not info["active"] and "no routing table of this box" in info["reason"], info
        assert info["routes"]["source"] == "nccl" and info["routes"]["routes"] == "all sizes: NCCL"


def test_ranks_running_different_kernel_libraries_go_to_nccl_whatever_the_setting(fake_kernel_module, caplog):
    caplog.set_level(logging.INFO, logger="sglang_sm120")
    store = dist.HashStore()

    def build(rank):
        backend = enabled_backend(rank, 2, store, "tp:libs")
        backend.facts.keys[1] = {**backend.facts.keys[1], "kernels": "other.so:1:2"}
        backend.build(7168, torch.bfloat16, ByteBound(8 * 7168 * 2, "t"), tune="off")
        return backend

    backends = run_ranks(2, build)
    assert all(b.routes.source == "nccl" for b in backends.values())
    assert "the ranks do not run the same kernel library" in _warnings(caplog)[-1]


def test_a_start_up_makes_at_most_four_agreement_rounds(fake_kernel_module, monkeypatch):
    """Gate, workspace outcome, a host-memory retry's outcome, routes: counted with the real store exchange."""
    store = dist.HashStore()
    monkeypatch.setattr(backend_mod, "local_facts", lambda device, mode: {
        "mode": mode, "node": "n0", "capability": [12, 0], "uuid": f"GPU-{threading.current_thread().name}",
        "p2p": {"GPU-0": True, "GPU-1": True}, "kernel_error": None,
        "key": fake_key_facts_of(int(threading.current_thread().name))})
    fake_kernel_module.IpcAllReduce = FakeIpcAllReduce.failing(probe_pairs=[(1, 0, "dropped")])

    def start(rank):
        backend = make_backend(rank, 2, store, name="tp:rounds", timeout_s=2.0)
        backend.resolve_gate()
        backend.build(7168, torch.bfloat16, ByteBound(8 * 7168 * 2, "t"), tune="off")
        return backend

    backends = run_ranks(2, start, named=True)
    assert all(b.active and b.memory == "host" for b in backends.values())  # the retry took place
    assert [b.rounds for b in backends.values()] == [4, 4]


def test_a_backend_whose_routes_were_never_resolved_sends_every_size_to_nccl():
    backend = make_backend(0, 2, None, timeout_s=1.0, name="tp:unrouted")
    backend.decision = GateDecision(True, "test")
    backend.workspace = FakeIpcAllReduce(max_numel=8 * 7168, device=torch.device("cpu"))
    backend.max_bytes, backend.max_fused_tokens, backend.hidden_size = 8 * 7168 * 2, 8, 7168
    x = torch.ones(2, 7168, dtype=torch.bfloat16)
    assert backend.routes.source == "nccl" and not backend.route_for(x) and not backend.fused_tokens
