"""IpcAllReduce on CPU: its construction over an exchange (ranks as threads, the library's ops stood in), what it
refuses, and what its ops hand to the library. The kernels themselves run in tests/gpu/."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from sgl_kernel_sm120 import _ext, policy
from sgl_kernel_sm120 import settings as switches
from sgl_kernel_sm120.errors import IpcAllReduceError, IpcAllReduceHostMemoryError
from sgl_kernel_sm120.ipc_allreduce import IpcAllReduce
from sgl_kernel_sm120.policy import Route, Schedule, Transport, WorkspaceShape
from tests.fake_ops import LIMITS_JSON, FakeOps, run_threads

LIMITS = policy.parse_kernel_limits(json.dumps(LIMITS_JSON))
RTX = WorkspaceShape(8, "device", "pcie", num_islands=2, clusters=(2, 4), sm_budget=188)


@pytest.fixture
def fake_library(monkeypatch, tmp_path):
    """The library's ops stood in (one FakeOps for every rank thread), a CUDA device that needs no driver."""
    ops = FakeOps()
    monkeypatch.setattr(_ext, "ops", lambda: ops)
    monkeypatch.setattr(policy, "kernel_limits", lambda: LIMITS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return ops, switches.KernelSettings(cache_dir=str(tmp_path), shm_dir=str(tmp_path))


def _build(rank, exchange, settings, **kwargs):
    args = {"max_numel": 1024, "link": "pcie", **kwargs}
    ar = IpcAllReduce(exchange, "cuda:0", args.pop("max_numel"), settings=settings, **args)
    rounds = exchange.rounds
    ar.close()
    return rounds


@pytest.mark.parametrize("memory, world, expected", [
    ("device", 1, 2),  # arguments, allocation; no peers, no probe
    ("device", 2, 3 + 1),  # arguments, allocation, opening the peers; the probe's one round
    ("device", 8, 3 + 1),  # the same at 8 ranks: no round grows with the world size or the slab
    ("host", 2, 1 + 2 + 2 + 1),  # arguments (with the size check), creation, mapping, pinning x 2; the probe
])
def test_construction_takes_the_rounds_its_docstring_counts(fake_library, memory, world, expected):
    ops, settings = fake_library
    ops.world = world
    answers = run_threads(world, lambda rank, ex: _build(rank, ex, settings, memory=memory))
    assert answers == [expected] * world, answers
    assert not ops.live, "a workspace was left unfreed"


def test_a_bad_argument_on_one_rank_fails_every_rank_and_leaves_nothing_built(fake_library):
    ops, settings = fake_library

    def build(rank, exchange):
        return _build(rank, exchange, settings, dtype=torch.float32 if rank == 1 else torch.bfloat16)

    answers = run_threads(2, build)
    for answer in answers:
        assert isinstance(answer, IpcAllReduceError) and "argument check failed" in str(answer), answer
        assert "rank 1: ValueError: dtype must be one of bfloat16, float16" in str(answer), answer
    assert not ops.live


def test_arguments_that_differ_across_ranks_fail_every_rank(fake_library):
    _, settings = fake_library
    answers = run_threads(2, lambda rank, ex: _build(rank, ex, settings, max_numel=1024 * (rank + 1)))
    assert all(isinstance(a, IpcAllReduceError) and "arguments differ across ranks" in str(a) for a in answers)


def test_a_bad_switch_on_one_rank_fails_every_rank(fake_library, monkeypatch):
    def read(environ=None):
        if threading.current_thread().name == "rank1":
            raise switches.SettingError("SGL_SM120_AR_WARN_S='-5': a number of seconds > 0")
        return fake_library[1]

    monkeypatch.setattr(switches, "read", read)
    answers = run_threads(2, lambda rank, ex: _build(rank, ex, None))
    assert all(isinstance(a, IpcAllReduceError) and "rank 1: SettingError: SGL_SM120_AR_WARN_S" in str(a)
               for a in answers), answers


def test_a_failed_allocation_on_one_rank_frees_every_rank_s_slab(fake_library, monkeypatch):
    ops, settings = fake_library
    real = ops.ws_ipc_handle

    def fail_on_rank1(handle):
        if threading.current_thread().name == "rank1":
            raise RuntimeError("cudaIpcGetMemHandle: stand-in failure")
        return real(handle)

    monkeypatch.setattr(ops, "ws_ipc_handle", fail_on_rank1)
    answers = run_threads(2, lambda rank, ex: _build(rank, ex, settings))
    assert all("workspace allocation failed (rank 1: RuntimeError" in str(a) for a in answers), answers
    assert not ops.live


def test_a_tmpfs_too_small_is_the_host_memory_error_on_every_rank(fake_library, monkeypatch):
    ops, settings = fake_library
    monkeypatch.setattr(ops, "host_shared_bytes_for", lambda *args: 1 << 60)
    answers = run_threads(2, lambda rank, ex: _build(rank, ex, settings, memory="host"))
    for answer in answers:
        assert isinstance(answer, IpcAllReduceHostMemoryError), answer
        assert f"{settings.shm_dir} has" in str(answer) and "SGL_SM120_SHM_DIR" in str(answer), answer
    assert not ops.live


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "cpu"}, "must be a CUDA device"),
    ({"dtype": torch.float32}, "bfloat16, float16"),
    ({"max_numel": 12}, "multiple of 8"),
    ({"timeout_s": 0.0}, "timeout_s"),
    ({"link": "ethernet"}, "link must be"),
    ({"memory": "gpu"}, "memory must be"),
    ({"on_timeout": "explode"}, "on_timeout must be"),
    ({"transport": "carrier-pigeon"}, "transport must be"),
    ({"islands": [[0], [0]]}, "partition"),
])
def test_the_constructor_rejects_bad_arguments_clearly(fake_library, kwargs, message):
    _, settings = fake_library
    args = {"device": "cuda:0", "max_numel": 1024, **kwargs}
    (answer,) = run_threads(1, lambda rank, ex: IpcAllReduce(ex, args.pop("device"), args.pop("max_numel"),
                                                            settings=settings, **args))
    assert isinstance(answer, IpcAllReduceError) and message in str(answer), answer


def test_no_driver_or_gpu_is_named_as_such(fake_library, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (answer,) = run_threads(1, lambda rank, ex: IpcAllReduce(ex, "cuda:0", 1024, settings=fake_library[1]))
    assert isinstance(answer, IpcAllReduceError) and "no CUDA driver/GPU" in str(answer), answer


# ----------------------------------------------------------------------------- the ops, on a built workspace
def _workspace(ops_calls=None) -> IpcAllReduce:
    ws = IpcAllReduce.__new__(IpcAllReduce)  # no GPU: the arguments of a call, not the call
    ws._handle, ws._shape, ws.use_pdl, ws._watchdog, ws.limits = 1, RTX, True, None, LIMITS
    ws.transport, ws.device, ws.max_numel = Transport.PUSH, torch.device("cpu"), 1 << 20
    return ws


def test_the_keyword_forms_are_the_seed_route_with_those_fields_replaced():
    ws = _workspace()
    x = torch.zeros(1 << 19, dtype=torch.bfloat16)
    seed = policy.seed_route(1 << 20, RTX)
    assert ws._route(x, None) == seed
    assert ws._route(x, None, schedule=Schedule.TWOSHOT, transport="staged", ctas=94) == \
        Route(Schedule.TWOSHOT, Transport.STAGED, "device", ctas=94)
    given = Route("ONESHOT", "pull", "device", ctas=188, cluster=4)
    assert ws._route(x, given) == given and ws._route(x, given, cluster=2).cluster == 2
    ws.transport = Transport.PULL  # the workspace's own transport for its seed routes
    assert ws._route(x, None).transport is Transport.PULL and ws._route(x, None, transport="auto").transport is \
        Transport.PULL
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="ctas"):
            ws._route(x, None, ctas=bad)
    with pytest.raises(ValueError, match="transport must be"):
        ws._route(x, None, transport="carrier-pigeon")


def test_a_launch_hands_the_resolved_route_to_the_op_field_by_field(monkeypatch):
    """The launch passes the route's numbers on and computes none: what reaches the op is the resolved route."""
    calls = []

    class Ops:
        def all_reduce(self, *args):
            calls.append(("plain", args[3:]))

        def all_reduce_add_rmsnorm(self, *args):
            calls.append(("fused", args[7:]))

    monkeypatch.setattr(_ext, "ops", lambda: Ops())
    ws = _workspace()
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=x.dtype)
    ws.launch(Route("TWOSHOT", "pull", "device", ctas=94, threads=128), x)
    ws.launch(policy.resolve(Route("ONESHOT", "staged", "device"), x.numel() * 2, RTX, LIMITS, False), x)
    ws.launch_fused(Route("ONESHOT", "push", "device", ctas=188, cluster=4), x, x, w, 1e-6)
    ws.launch_fused(policy.resolve(Route("ISLAND", "staged", "device", window=3), 384, RTX, LIMITS, True), x, x, w,
                    1e-6)
    staged_threads = policy.plain_threads(x.numel() * 2, Transport.STAGED, ctas=188, limits=LIMITS)
    assert calls == [  # the window last: 0 asks for the kernels' default
        ("plain", (int(Schedule.TWOSHOT), 128, 94, True, Transport.PULL.code, 0)),
        ("plain", (int(Schedule.ONESHOT), staged_threads, 188, True, Transport.STAGED.code, 0)),
        ("fused", (int(Schedule.ONESHOT), 188, True, 4, Transport.PUSH.code, 0)),
        ("fused", (int(Schedule.ISLAND), 188, True, 0, Transport.STAGED.code, 3)),
    ]


@pytest.mark.parametrize("unaligned", ["inp", "residual", "weight"])
def test_a_fused_launch_copies_a_tensor_at_an_unaligned_address_and_passes_aligned_ones_as_they_are(
        monkeypatch, unaligned):
    """The kernels read 16-byte packs: an input at an odd offset (a view into a larger tensor) is copied to a fresh,
    aligned one with the same values; aligned inputs reach the op themselves, whichever entry point is used."""
    seen = []

    class Ops:
        def all_reduce_add_rmsnorm(self, handle, inp, residual, weight, *rest):
            seen.append((inp, residual, weight))

    monkeypatch.setattr(_ext, "ops", lambda: Ops())
    ws = _workspace()
    route = Route("ONESHOT", "push", "device", ctas=188, cluster=4)
    base = torch.arange(3 * 64 + 1, dtype=torch.bfloat16)
    tensors = {"inp": torch.ones(3, 64, dtype=torch.bfloat16), "residual": torch.ones(3, 64, dtype=torch.bfloat16),
               "weight": torch.ones(64, dtype=torch.bfloat16)}
    tensors[unaligned] = (base[1:] if unaligned != "weight" else base[1:65]).view(tensors[unaligned].shape)
    assert tensors[unaligned].data_ptr() % 16
    given = (tensors["inp"], tensors["residual"], tensors["weight"])
    ws.launch_fused(route, *given, 1e-6)
    ws.launch_fused_into(route, *given, 1e-6, torch.empty(3, 64, dtype=torch.bfloat16), None)
    assert len(seen) == 2
    for passed in seen:
        for name, sent, original in zip(("inp", "residual", "weight"), passed, given, strict=True):
            assert sent.data_ptr() % 16 == 0 and torch.equal(sent, original), name
            assert (sent is original) == (name != unaligned), name
            assert (sent is original) == (name != unaligned), name


def test_what_the_workspace_takes_is_a_function_of_the_tensor_and_its_fixed_attributes():
    ws = _workspace()
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert ws.supports(x) and ws.supports_add_rmsnorm(x, x, torch.ones(64, dtype=x.dtype))
    assert not ws.supports(x.to(torch.float32)) and not ws.supports(x.t()) and not ws.supports(x[:, :60])
    assert not ws.supports(torch.zeros(0, dtype=torch.bfloat16))
    assert not ws.supports(torch.zeros(ws.max_numel + 8, dtype=torch.bfloat16))
    ws.device = torch.device("cuda", 0)  # another device: one comparison covers a CPU tensor too
    assert not ws.supports(x)
    ws.device = torch.device("cpu")
    assert not ws.supports_add_rmsnorm(x.flatten())  # the fused op takes [rows, hidden]
    assert not ws.supports_add_rmsnorm(torch.zeros(1, LIMITS.max_fused_hidden + 8, dtype=torch.bfloat16))
    assert not ws.supports_add_rmsnorm(x, x[:2], None) and not ws.supports_add_rmsnorm(x, None, torch.ones(8))
    assert ws.admits_fused(3, 7168, torch.bfloat16) and ws.admits_fused(1, LIMITS.max_fused_hidden, torch.float16)
    assert not ws.admits_fused(3, 7164, torch.bfloat16) and not ws.admits_fused(3, 64, torch.float32)
    assert not ws.admits_fused(1, LIMITS.max_fused_hidden + 8, torch.bfloat16)
    assert not ws.admits_fused(ws.max_numel // 64 + 1, 64, torch.bfloat16)
    assert not ws.admits_fused(0, 64, torch.bfloat16)


def test_the_checked_op_explains_what_it_refuses_and_a_closed_workspace_runs_nothing():
    ws = _workspace()
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    route = Route("ONESHOT")
    assert ws.refusal(x, route, fused=False) is None
    assert "check supports() first" in ws.refusal(x.to(torch.float32), route, fused=False)
    assert "check supports_add_rmsnorm() first" in ws.refusal(x, route, fused=True, residual=x[:2])
    assert "every output must be contiguous" in ws.refusal(x, route, fused=False, outs=(x.t(),))
    assert "host memory" in ws.refusal(x, dataclasses.replace(route, memory="host"), fused=False)
    ws._shape = dataclasses.replace(RTX, num_islands=1)
    with pytest.raises(ValueError, match="cannot run this call: ISLAND needs a workspace with islands"):
        ws.all_reduce(x, schedule="ISLAND")
    ws._handle = 0
    assert ws.refusal(x, route, fused=False) == "this workspace is closed"

