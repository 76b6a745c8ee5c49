"""bench_verify's forward on CPU, with N ranks emulated by threads in lockstep.

Checks that the forward driven by the op list runs for both backends and every model kind, and measures how far
the fused path's final hidden states drift from the NCCL path's: this is where bench_verify.FINAL_REL_TOL and
the GPU test's tolerances come from. The emulated NCCL sums in bf16 rank by rank (like a ring); the emulated
fused kernel sums in fp32 and rounds the residual once.
"""

from __future__ import annotations

import threading
import types

import pytest

torch = pytest.importorskip("torch")

from benchmarks import bench_verify as bv  # noqa: E402
from benchmarks.harness import norms  # noqa: E402
from benchmarks.workloads import verify_model as vm  # noqa: E402
from benchmarks.workloads import verify_pattern as vp  # noqa: E402


class Exchange:
    def __init__(self, n):
        self.slots, self.barrier = [None] * n, threading.Barrier(n, timeout=60)

    def gather(self, rank, t):
        self.slots[rank] = t.detach().clone()
        self.barrier.wait()
        vals = list(self.slots)
        self.barrier.wait()
        return vals


class EmuNccl(vm.NcclComm):
    def __init__(self, d, norm, ex):
        super().__init__(d, norm)
        self.ex = ex

    def all_reduce(self, t):
        vals = self.ex.gather(self.d.rank, t)
        acc = vals[0]
        for v in vals[1:]:
            acc = (acc.float() + v.float()).to(torch.bfloat16)
        t.copy_(acc)
        return t


class EmuKernel:
    """Stand-in for IpcAllReduce with the fused contract; ``broken`` drops the all-reduce (negative control)."""

    def __init__(self, d, ex, broken=False):
        self.d, self.ex, self.broken = d, ex, broken

    def _sum(self, t):
        vals = self.ex.gather(self.d.rank, t)
        return t.float() if self.broken else sum(v.float() for v in vals)

    def all_reduce(self, t, out=None):
        return self._sum(t).to(torch.bfloat16)

    def all_reduce_add_rmsnorm(self, part, residual, w, eps, norm_out=None, residual_out=None):
        r = (self._sum(part) + residual.float()).to(torch.bfloat16)
        return norms.reference_add_rmsnorm(r, None, w, eps)[0], r


def run(cfg, world, gemm, T, backend, broken=False, capture=True):
    ex = Exchange(world)
    outs, errors = [None] * world, []
    norm = norms.torch_norm_kernel()

    def worker(rank):
        try:
            torch.set_num_threads(1)
            d = types.SimpleNamespace(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
            model = vm.Model(cfg, d, gemm, T, 0, 40.0)
            model.prepare_tokens(T)
            if backend == "nccl":
                comm = EmuNccl(d, norm, ex)
            else:
                comm = vm.Sm120Comm(d, norm, EmuKernel(d, ex, broken))
            ops = vp.build_verify_pattern(cfg, fuse=comm.fuse, eagle3_capture=capture)
            h = torch.empty(T, cfg.hidden_size, dtype=torch.bfloat16)
            x, aux = model.forward(ops, comm, norm, T, h)
            assert len(aux) == (len(cfg.eagle3_capture_layers) if capture else 0)
            outs[rank] = x
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            ex.barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs


def rel_rms(a, b):
    d = a.float() - b.float()
    return float(d.pow(2).mean().sqrt() / a.float().pow(2).mean().sqrt())


@pytest.fixture(scope="module")
def tiny():
    return vp.load_config("tiny_test")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("T", [1, 8])
def test_fused_path_within_tolerance_with_gemms(tiny, world, T):
    a = run(tiny, world, True, T, "nccl")
    b = run(tiny, world, True, T, "sm120")
    for outs in (a, b):  # every rank ends with the same bits
        assert all(torch.equal(outs[0], o) for o in outs)
    assert a[0].shape == (T, tiny.hidden_size) and torch.isfinite(a[0].float()).all()
    diff = rel_rms(a[0], b[0])
    assert diff <= bv.FINAL_REL_TOL / 3, diff  # measured ~0.01: a comfortable margin
    # negative control: a fused op that forgets to all-reduce is far outside the tolerance
    bad = run(tiny, world, True, T, "sm120", broken=True)
    assert rel_rms(a[0], bad[0]) >= 10 * bv.FINAL_REL_TOL


def test_comm_only_two_ranks_is_bitwise_equal(tiny):
    """Comm only, 2 ranks: the partials are identical, so the sum (2x) is exact and both paths round once."""
    a = run(tiny, 2, False, 3, "nccl")
    b = run(tiny, 2, False, 3, "sm120")
    assert torch.equal(a[0], b[0])
    # the GPU test allows 0.005 here (norm kernels may differ in the last fp32 bit); a broken fused op is 4x that
    bad = run(tiny, 2, False, 3, "sm120", broken=True)
    assert rel_rms(a[0], bad[0]) >= 0.015


def test_without_capture_layers(tiny):
    a = run(tiny, 2, True, 2, "nccl", capture=False)
    b = run(tiny, 2, True, 2, "sm120", capture=False)
    assert rel_rms(a[0], b[0]) <= bv.FINAL_REL_TOL / 3


def test_dense_gqa_model_runs():
    cfg = vp.config_from_dict({
        "name": "tiny_dense", "hidden_size": 256, "num_layers": 3, "first_k_dense": 3,
        "eagle3_capture_layers": [1], "attention": {"type": "gqa", "num_heads": 4, "num_kv_heads": 2, "head_dim": 32},
        "mlp": {"intermediate_size": 512}, "moe": None,
    })
    a = run(cfg, 2, True, 2, "nccl")
    b = run(cfg, 2, True, 2, "sm120")
    assert rel_rms(a[0], b[0]) <= bv.FINAL_REL_TOL


def test_expert_cap_is_recorded(tiny):
    d = types.SimpleNamespace(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    m = vm.Model(tiny, d, True, 64, 0, max_expert_gib=1e-5)
    assert "experts_capped" in m.notes and m.e_alloc >= 1
    m.prepare_tokens(64)
    x = torch.randn(64, tiny.hidden_size).to(torch.bfloat16)
    assert m.mlp(x, moe=True).shape == x.shape


def test_rows_of_another_machine_or_other_timing_settings_are_not_merged():
    merge_refusal = bv.merge_refusal
    hw = {"gpu": "NVIDIA H200", "capability": "9.0", "driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0",
          "nccl": "2.28.9", "world_size": 2, "memory_gib": 139.8}
    settings = {"iters": 20, "warmup_replays": 3}
    old = {"hardware": dict(hw, memory_gib=140.0), "settings": dict(settings, statistic="...")}
    assert merge_refusal(old, hw, settings) is None  # fields that do not change the timings may differ
    assert merge_refusal({**old, "hardware": dict(hw, driver="575.1")}, hw, settings) == \
        "driver '575.1' there, '580.159.04' here"
    assert merge_refusal({**old, "settings": {"iters": 50, "warmup_replays": 3}}, hw, settings) == \
        "iters 50 there, 20 here"
    assert "gpu" in merge_refusal({"settings": settings}, hw, settings)  # a file without hardware: not merged


def test_an_untuned_overlay_is_warned_of():
    from sglang_sm120.routing import book

    untuned = {"routes": {"source": book.ALL_NCCL, "why": "no measured table for this box"}}
    warning = bv.all_nccl_warning("sglang_on", untuned)
    assert warning and "every size to NCCL" in warning and "no measured table for this box" in warning
    for source in (book.TABLE, book.SEEDS):
        assert bv.all_nccl_warning("sglang_on", {"routes": {"source": source}}) is None
    assert bv.all_nccl_warning("sglang_on", {"active": False}) is None
