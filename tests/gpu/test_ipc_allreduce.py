"""GPU tests of sgl_kernel_sm120.IpcAllReduce: multi-process, every check reduced over all ranks.

The two-rank scenarios run one after another on one pair of spawned ranks (harness.run_scenarios: one start of the
processes, CUDA and gloo for them all), each test asserting its own scenario's outcome; the scenarios of other world
sizes spawn their own ranks. The scenario whose kernel traps runs last (it ends the waiting rank's CUDA context).

Exactness: inputs are small integers, so every partial sum is exactly representable in bf16/fp16 and in fp32, and
the sum is exact whatever the order. residual_out must then equal the reference bit for bit; norm_out goes through
rsqrt and a mean whose fp32 summation order differs between the kernel (a block tree) and torch, so it may differ
by one rounding step of the output type: 1 ulp is allowed (2^-7 relative for bf16, 2^-10 for fp16).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist

from sgl_kernel_sm120 import (
    IpcAllReduce,
    IpcAllReduceProbeError,
    IpcAllReduceTimeoutError,
    Schedule,
    _ext,
    cluster_check,
    policy,
    reference_all_reduce,
    reference_all_reduce_add_rmsnorm,
)
from sgl_kernel_sm120.settings import read as read_settings
from tests.gpu.harness import (
    dirty_halves,
    need_ranks,
    run_ranks,
    run_scenarios,
    selected_scenarios,
    shared_cluster_cache,  # noqa: F401 - a fixture
    spawn_env,
    synchronize,
)
from tests.support.env import spelled_out

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cluster_cache")]

ROWS = [1, 2, 3, 4, 7, 8, 16, 64, 128, 257]
HIDDENS = [7168, 6144, 4096, 2048, 8]
DTYPES = [torch.bfloat16, torch.float16]
EPS = 1e-6
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

# Which workspace the scenarios build: "device" (CUDA IPC) or "host" (shared pinned host memory, no P2P).
# tests/gpu/test_hostmem_allreduce.py sets it for its runs; the spawned ranks inherit the environment.
MEMORY_ENV = "SGL_SM120_TEST_MEMORY"


def _memory() -> str:
    return os.environ.get(MEMORY_ENV, "device")


def _islands(world: int):
    # Two islands of world/2, the 8-rank PCIe layout scaled down: exercises the cross-island phase.
    if _memory() == "host":
        return None  # host memory has no islands
    return [list(range(world // 2)), list(range(world // 2, world))] if world >= 2 else None


def _schedules(world: int):
    if world < 2:
        return [Schedule.ONESHOT]
    if _memory() == "host":
        return [Schedule.ONESHOT, Schedule.TWOSHOT]
    return [Schedule.ONESHOT, Schedule.TWOSHOT, Schedule.ISLAND]


def _int_tensor(shape, dtype, seed: int, device, low=-8, high=9) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int32).to(dtype).to(device)


def _make(world, rank, max_numel, **kw):
    return IpcAllReduce(
        dist.group.WORLD, torch.cuda.current_device(), max_numel, islands=_islands(world), memory=_memory(), **kw
    )


def _digest(t: torch.Tensor) -> list:
    """Two position-weighted sums of the raw 16-bit words (on the GPU): equal digests mean equal bits, in practice."""
    words = t.detach().contiguous().view(torch.int16).flatten().to(torch.int64)
    pos = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64)
    return torch.stack([(words * pos).sum(), (words * (pos * pos % 1000003)).sum()]).tolist() + [words.numel()]


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    """Bitwise equality across ranks, through the digests (shipping every tensor through gloo would be slow)."""
    digest = _digest(t)
    digests: list = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    return all(d == digest for d in digests)


class _Digests:
    """Digests collected along a sweep and compared across ranks in one gather at its end."""

    def __init__(self):
        self.tags, self.digests = [], []

    def add(self, tag: str, t: torch.Tensor) -> None:
        self.tags.append(tag)
        self.digests.append(_digest(t))

    def differing(self) -> list[str]:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.digests)
        return [f"{tag}: not bitwise identical across ranks" for i, tag in enumerate(self.tags)
                if any(rank[i] != self.digests[i] for rank in every)]


def _stable_seed(*parts) -> int:
    # Python's hash() of a str differs between processes; every rank must derive the same inputs.
    return zlib.crc32(repr(parts).encode()) % (1 << 30)


def _check_norm(tag, norm, ref_norm, dtype, failures) -> None:
    tol = ULP[dtype] * ref_norm.float().abs() + 1e-6
    bad = ((norm.float() - ref_norm.float()).abs() > tol).sum().item()
    if bad:
        failures.append(f"{tag}: norm_out off by more than 1 ulp in {bad} elements")


# --------------------------------------------------------------------------------------------------------
def _scenario_exact_shapes(rank, world, rows_list, hiddens, dtypes, timeout_s=None):
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, max(rows_list) * max(hiddens), timeout_s=timeout_s)
    failures, digests = [], _Digests()
    try:
        for dtype, rows, hidden, schedule in itertools.product(dtypes, rows_list, hiddens, _schedules(world)):
            shape = (rows, hidden)
            tag = f"{dtype} {shape} {schedule.name}"
            if schedule is Schedule.ONESHOT and rows * hidden > ar.oneshot_max_numel:
                # Host memory at 4 and 8 ranks sizes its one-shot slots by the one-shot range only (policy.py):
                # forcing one-shot past it is refused, clearly.
                try:
                    ar.all_reduce(_int_tensor(shape, dtype, 0, dev), schedule=schedule)
                except ValueError as err:
                    if "one-shot takes at most" not in str(err):
                        failures.append(f"{tag}: unclear refusal: {err}")
                else:
                    failures.append(f"{tag}: one-shot past the workspace's one-shot bound was not refused")
                continue
            seed = _stable_seed(rows, hidden, str(dtype), int(schedule))
            inputs = [_int_tensor(shape, dtype, seed + r, dev) for r in range(world)]
            residual = _int_tensor(shape, dtype, seed + 1000, dev)
            weight = _int_tensor((hidden,), dtype, seed + 2000, dev, 1, 4)
            x = inputs[rank]
            x_before, res_before = x.clone(), residual.clone()

            out = ar.all_reduce(x, schedule=schedule)
            norm, res_out = ar.all_reduce_add_rmsnorm(x, residual, weight, EPS, schedule=schedule)
            ref_norm, ref_res = reference_all_reduce_add_rmsnorm(inputs, residual, weight, EPS)
            expected = sum(t.float() for t in inputs).to(dtype)
            if not torch.equal(out, expected):
                failures.append(f"{tag}: all_reduce differs in {(out != expected).sum().item()} elements")
            if not torch.equal(res_out, ref_res):
                failures.append(f"{tag}: residual_out differs in {(res_out != ref_res).sum().item()} elements")
            _check_norm(tag, norm, ref_norm, dtype, failures)
            if not (torch.equal(x, x_before) and torch.equal(residual, res_before)):
                failures.append(f"{tag}: an input was written")
            for name, t in (("all_reduce", out), ("norm_out", norm), ("residual_out", res_out)):
                digests.add(f"{tag} {name}", t)
        failures += digests.differing()
        dirty = dirty_halves(ar)
        if dirty:
            failures.append(f"scratch not clean after the sweep: {dirty} half-words")
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


# --------------------------------------------------------------------------------------------------------
def _scenario_cluster_sizes_and_fallback(rank, world):
    """Every fused one-shot grid shape (one CTA per row, a row over 2, 4 or 8 CTAs of a cluster) on exact inputs:
    residual_out exact and the same bits whatever the cluster, norm_out within 1 ulp and bitwise identical across
    ranks. Then, with the cluster check failing on purpose (SGL_SM120_DEBUG_CLUSTER_CHECK=trap: the check's child
    process runs a trapping kernel, as an illegal instruction would), this rank survives its child's trap, a
    workspace built under the switch sees the failed verdict, the group agrees on no clusters,
    the fallback is reported, its launch limits are the same on every rank and its results are bitwise those of the
    workspace launching clusters."""
    dev = torch.device("cuda", torch.cuda.current_device())
    with_clusters = _make(world, rank, 100 * 7168)
    failures, digests = [], _Digests()
    without = None
    try:
        for rows, hidden in itertools.product([1, 3, 16, 64, 100], [7168, 4096, 2048]):
            seed = _stable_seed("cluster", rows, hidden)
            inputs = [_int_tensor((rows, hidden), torch.bfloat16, seed + r, dev) for r in range(world)]
            residual = _int_tensor((rows, hidden), torch.bfloat16, seed + 1000, dev)
            weight = _int_tensor((hidden,), torch.bfloat16, seed + 2000, dev, 1, 4)
            ref_norm, ref_res = reference_all_reduce_add_rmsnorm(inputs, residual, weight, EPS)
            for cluster in (1, 2, 4, 8):
                tag = f"[{rows}, {hidden}] cluster {cluster}"
                norm, res_out = with_clusters.all_reduce_add_rmsnorm(inputs[rank], residual, weight, EPS,
                                                                     schedule=Schedule.ONESHOT, cluster=cluster)
                if not torch.equal(res_out, ref_res):
                    failures.append(f"{tag}: residual_out differs in {(res_out != ref_res).sum().item()} elements")
                _check_norm(tag, norm, ref_norm, torch.bfloat16, failures)
                digests.add(f"{tag} norm_out", norm)
        for name, value in spelled_out("SGL_SM120_DEBUG_CLUSTER_CHECK", "trap").items():
            os.environ[name] = value
        try:
            props = torch.cuda.get_device_properties(dev)
            trapped = cluster_check.verdict_for(dev.index, str(props.uuid), _ext.library_path(), read_settings())
            if trapped.ok or "cluster check" not in trapped.reason:
                failures.append(f"the trapping check's child did not fail as a verdict: {trapped}")
            torch.cuda.synchronize()  # this rank's own context survived its child's trap
            without = _make(world, rank, 100 * 7168)
        finally:
            for name in spelled_out("SGL_SM120_DEBUG_CLUSTER_CHECK", ""):
                os.environ.pop(name, None)
        if sorted(with_clusters.fused_clusters["clusters"]) != [2, 4, 8]:
            failures.append(f"the cluster check failed on a GPU that launches clusters: {with_clusters.fused_clusters}")
        if without.fused_clusters["clusters"]:
            failures.append(f"clusters still used after a failed check: {without.fused_clusters}")
        reason = without.fused_clusters["reason"]
        if "cluster check" not in reason or "one CTA per row" not in without.describe_fused_launch():
            failures.append(f"the fallback is not reported: {reason!r} / {without.describe_fused_launch()!r}")
        for name, ar in (("with clusters", with_clusters), ("without", without)):
            limits = [int(v) for v in _ext.ops().ws_launch_limits(ar._handle)]
            digests.add(f"the launch limits {name} ({limits})", torch.tensor(limits, dtype=torch.int16))
        for rows, hidden in itertools.product([1, 3, 16, 23, 40], [7168, 5120, 2048]):
            seed = _stable_seed("fallback", rows, hidden)
            inputs = [_int_tensor((rows, hidden), torch.bfloat16, seed + r, dev) for r in range(world)]
            residual = _int_tensor((rows, hidden), torch.bfloat16, seed + 1000, dev)
            weight = _int_tensor((hidden,), torch.bfloat16, seed + 2000, dev, 1, 4)
            a = with_clusters.all_reduce_add_rmsnorm(inputs[rank], residual, weight, EPS, schedule=Schedule.ONESHOT)
            b = without.all_reduce_add_rmsnorm(inputs[rank], residual, weight, EPS, schedule=Schedule.ONESHOT)
            for name, x, y in (("norm_out", a[0], b[0]), ("residual_out", a[1], b[1])):
                if not torch.equal(x.view(torch.int16), y.view(torch.int16)):
                    failures.append(f"[{rows}, {hidden}] {name}: the fallback's bits differ from the clusters'")
            digests.add(f"[{rows}, {hidden}] the fallback's norm_out", b[0])
        failures += digests.differing()
        if dirty_halves(with_clusters):
            failures.append("scratch not clean after the cluster sweep")
    finally:
        with_clusters.close()
        if without is not None:
            without.close()
    assert not failures, "\n".join(failures[:20])


# --------------------------------------------------------------------------------------------------------
def _scenario_random_and_special_values(rank, world):
    """Random inputs against an fp64 reference (fp32 accumulation, one rounding), and zeros, signed zeros, large and
    tiny values summed exactly and bitwise alike on every rank."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 64 * 7168)
    failures, digests = [], _Digests()
    try:
        for dtype, rows, schedule in itertools.product(DTYPES, [1, 3, 64], _schedules(world)):
            gens = [torch.Generator(device="cpu").manual_seed(100 * r + rows) for r in range(world)]
            inputs = [torch.randn(rows, 7168, generator=g).to(dtype).to(dev) for g in gens]
            if schedule is Schedule.ONESHOT and rows * 7168 > ar.oneshot_max_numel:
                continue  # host memory at 4 and 8 ranks
            out = ar.all_reduce(inputs[rank], schedule=schedule)
            ref = sum(t.double() for t in inputs)
            # fp32 accumulation then one rounding: half an ulp of the output plus the fp32 sum's own error.
            tol = 0.5 * ULP[dtype] * ref.abs() + world * 2.0**-24 * sum(t.double().abs() for t in inputs) + 1e-30
            bad = ((out.double() - ref).abs() > tol).sum().item()
            if bad:
                failures.append(f"{dtype} rows={rows} {schedule.name}: {bad} elements outside the fp64 bound")
        for dtype in DTYPES:
            info = torch.finfo(dtype)
            specials = torch.tensor(
                [0.0, -0.0, info.max / 4, -info.max / 4, info.tiny, -info.tiny, info.tiny / 8, 1.0, -1.0, 65504 / 8],
                dtype=torch.float32,
            ).to(dtype)
            base = specials.repeat(4096 // specials.numel() + 1)[:4096]
            mine = torch.roll(base, shifts=rank).to(dev)  # different pairings on each rank
            expected = reference_all_reduce([torch.roll(base, shifts=r).to(dev) for r in range(world)])
            for schedule in _schedules(world):
                out = ar.all_reduce(mine, schedule=schedule)
                # torch.equal treats -0.0 == +0.0: the kernel may return +0.0 for a sum of -0.0s (I2).
                if not torch.equal(out, expected) or torch.isnan(out).any():
                    failures.append(f"{dtype} {schedule.name}: special values differ")
                digests.add(f"{dtype} {schedule.name} special values", out)
        failures += digests.differing()
        if dirty_halves(ar):
            failures.append("scratch not clean")
    finally:
        ar.close()
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------------------------------
SHAPES_CYCLE = [(3, 7168), (64, 7168), (1, 8), (16, 4096), (257, 2048)]


def _call_inputs(call: int, world: int, dev, dtype=torch.bfloat16):
    rows, hidden = SHAPES_CYCLE[call % len(SHAPES_CYCLE)]
    inputs = [_int_tensor((rows, hidden), dtype, 7919 * call + r, dev) for r in range(world)]
    residual = _int_tensor((rows, hidden), dtype, 7919 * call + 97, dev)
    weight = _int_tensor((hidden,), dtype, 7919 * call + 98, dev, 1, 4)
    return inputs, residual, weight


def _scenario_back_to_back(rank, world, calls):
    """Calls of every size, schedule and kind issued back to back with no synchronize between them: the device's
    call counter (I5) keeps them apart, every result is exact and the scratch is clean after them."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 257 * 7168)
    failures = []
    pending = []
    try:
        synchronize(ar)
        seq0 = ar.calls_completed()
        for call in range(calls):
            inputs, residual, weight = _call_inputs(call, world, dev)
            schedule = _schedules(world)[call % len(_schedules(world))]
            if call % 2:
                pending.append((call, "plain", ar.all_reduce(inputs[rank], schedule=schedule), inputs, None, None))
            else:
                got = ar.all_reduce_add_rmsnorm(inputs[rank], residual, weight, EPS, schedule=schedule)
                pending.append((call, "fused", got, inputs, residual, weight))
        synchronize(ar)
        for call, kind, got, inputs, residual, weight in pending:
            if kind == "plain":
                ok = torch.equal(got, reference_all_reduce(inputs))
            else:
                ok = torch.equal(got[1], reference_all_reduce_add_rmsnorm(inputs, residual, weight, EPS)[1])
            if not ok:
                failures.append(f"call {call} ({kind}) wrong")
        if ar.calls_completed() - seq0 != calls:
            failures.append(f"device call counter advanced by {ar.calls_completed() - seq0}, expected {calls}")
        if dirty_halves(ar):
            failures.append("scratch not clean after back-to-back calls")
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


# --------------------------------------------------------------------------------------------------------
def _scenario_graph(rank, world, calls_in_graph, replays, on_timeout="trap"):
    """A CUDA graph of mixed calls (sizes, plain and fused, every schedule) replayed with fresh inputs. With ranks
    time-slicing one GPU, a rank runs many captured calls in one slice, which is what lets the negative controls
    (tests/gpu/test_negative_controls.py) catch a broken double buffer there. An odd number of calls makes the
    replays start on alternating parities."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 257 * 7168, on_timeout=on_timeout)
    failures = []
    try:
        static = []  # static inputs, one set per captured call (distinct addresses inside one graph)
        for call in range(calls_in_graph):
            inputs, residual, weight = _call_inputs(call, world, dev)
            static.append((inputs[rank].clone(), residual.clone(), weight.clone()))
        outputs = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        schedules = _schedules(world)
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                for call, (x, residual, weight) in enumerate(static):
                    schedule = schedules[call % len(schedules)]
                    if call % 2:
                        outputs.append(ar.all_reduce(x, schedule=schedule))
                    else:
                        outputs.append(ar.all_reduce_add_rmsnorm(x, residual, weight, EPS, schedule=schedule))
        torch.cuda.current_stream().wait_stream(stream)
        for replay in range(replays):
            expected = []
            for call, (x, residual, weight) in enumerate(static):
                # the same shapes as at capture (the cycle index is unchanged), fresh values
                inputs, res_new, w_new = _call_inputs(call + len(SHAPES_CYCLE) * 200 * (replay + 1), world, dev)
                x.copy_(inputs[rank])
                residual.copy_(res_new)
                weight.copy_(w_new)
                if call % 2:
                    expected.append(reference_all_reduce(inputs))
                else:
                    expected.append(reference_all_reduce_add_rmsnorm(inputs, res_new, w_new, EPS)[1])
            graph.replay()
            torch.cuda.synchronize()
            if ar.timeout_error() is not None:
                failures.append(f"replay {replay}: {ar.timeout_error()}")
                break
            for call, (got, exp) in enumerate(zip(outputs, expected, strict=True)):
                value = got if call % 2 else got[1]
                if not torch.equal(value, exp):
                    failures.append(f"replay {replay} call {call} wrong")
            if failures:
                break
        if dirty_halves(ar):
            failures.append("scratch not clean after replays")
        del graph
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


# --------------------------------------------------------------------------------------------------------
def _scenario_create_close(rank, world, cycles):
    """Workspaces made, used and closed in a loop leak no device memory, also when a peer reaches close() late
    (every other cycle): its peers wait for it before freeing their slabs. A leaked slab is whole 2 MiB
    allocations, so a few cycles show any leak well past the bound."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.ones(3, 7168, dtype=torch.bfloat16, device=dev)
    ar = _make(world, rank, 64 * 7168)  # warm up CUDA/IPC state once
    ar.all_reduce(x)
    ar.close()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # mem_get_info is the whole GPU's: with ranks sharing a GPU, measure only once every rank has freed its slab
    # (close() frees after its barrier, so a fast rank would otherwise count a slow peer's slab as a leak).
    dist.barrier()
    free_before = torch.cuda.mem_get_info()[0]
    for cycle in range(cycles):
        ar = _make(world, rank, 64 * 7168)
        out = ar.all_reduce(x)
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(x, world)), "wrong sum during create/close cycles"
        if cycle % 2 and rank == world - 1:
            time.sleep(0.05)  # its peers reach close first: they must wait for it before freeing their slabs
        ar.close()
    del out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()
    leaked = free_before - torch.cuda.mem_get_info()[0]
    assert leaked < 8 << 20, f"{leaked / 2**20:.1f} MiB of device memory not returned after {cycles} cycles"


# --------------------------------------------------------------------------------------------------------
def _scenario_rank_skips_a_call(rank, world, on_timeout="trap"):
    """The last rank never makes call #1; every other rank must end in IpcAllReduceTimeoutError naming it, and the
    next call on its workspace must refuse at once with the same error. In trap mode the waiting ranks' CUDA
    contexts are gone afterwards; in exit mode (csrc/ar_protocol.cuh I7, I12) the context survives, a direct launch
    is refused by the op and a new workspace works."""
    dev = torch.device("cuda", torch.cuda.current_device())
    skipper = world - 1
    ar = _make(world, rank, 64 * 7168, timeout_s=1.0, on_timeout=on_timeout)
    # Forced one-shot must fit the workspace's one-shot region, which host memory sizes by what host mode uses
    # (policy.HOST_ONESHOT_MAX_BYTES: 8 KiB at 8 ranks, less than one row of 7168).
    cols = 7168 if ar.oneshot_max_numel >= 3 * 7168 else 1024
    x = torch.ones(3, cols, dtype=torch.bfloat16, device=dev)
    ar.all_reduce(x, schedule=Schedule.ONESHOT)
    synchronize(ar)
    dist.barrier()
    failure = None
    if rank != skipper:
        # Whatever happens here, this rank must still reach the barrier below: leaving early would put it in the
        # harness's verdict all-gather while the others wait in that barrier.
        try:
            # One-shot: every waiting rank waits for the skipper itself, so every rank must name it.
            out = ar.all_reduce(x, schedule=Schedule.ONESHOT)
            try:
                synchronize(ar)
            except IpcAllReduceTimeoutError as err:
                assert err.rank == rank and err.peer == skipper and err.seq == 1, f"wrong details: {err}"
                assert f"rank {skipper}" in str(err) and "call #1" in str(err), str(err)
                assert err.context_lost == (on_timeout == "trap"), str(err)
            else:
                raise AssertionError("a call whose peer never arrived completed instead of timing out")
            try:
                ar.all_reduce(x)
            except IpcAllReduceTimeoutError:
                pass
            else:
                raise AssertionError("a timed-out workspace accepted another call")
            if on_timeout == "exit":
                nbytes = x.numel() * x.element_size()
                route = policy.resolve(policy.seed_route(nbytes, ar.shape), nbytes, ar.shape, ar.limits, False)
                try:
                    ar.launch(route, x)  # the launch trusts its caller; the op itself refuses
                except RuntimeError as err:
                    assert "timed out" in str(err) and "runs nothing more" in str(err), str(err)
                else:
                    raise AssertionError("the op launched on a timed-out workspace")
                del out
                torch.cuda.synchronize()  # the context survived: this must not raise
        except BaseException:  # noqa: B036 - reported after the barrier
            failure = traceback.format_exc()
    dist.barrier()
    # A timed-out rank's workspace (and, in trap mode, its context) is unusable: its close is local, and the
    # skipper must not wait for it either.
    ar.close(collective=False)
    if on_timeout == "exit" and failure is None:
        fresh = _make(world, rank, 64 * 7168, timeout_s=30.0, on_timeout="exit")
        try:
            out = fresh.all_reduce(x)
            synchronize(fresh)
            if not torch.equal(out, torch.full_like(x, world)):
                failure = "a fresh workspace after the timeout gave a wrong sum"
        finally:
            fresh.close()
    assert failure is None, failure


# --------------------------------------------------------------------------------------------------------
class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _scenario_late_peer(rank, world, late_call, sleep_s):
    """I9: a peer that is late (a cold-cache compile in its first forward) is waited for, and the wait is reported
    once, as a warning of the package's loggers naming the call, the phase and the peer; nothing fails."""
    collect = _Collect()
    package_log = logging.getLogger("sgl_kernel_sm120")  # the watchdog logs from its own module, below it
    package_log.addHandler(collect)
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 64 * 7168, warn_after_s=1.0, timeout_s=60.0)
    try:
        for call in range(late_call + 3):
            if call == late_call and rank == world - 1:
                time.sleep(sleep_s)
            x = _int_tensor((3, 7168), torch.bfloat16, _stable_seed(call, rank), dev)
            out = ar.all_reduce(x)
            synchronize(ar)
            expect = reference_all_reduce(
                [_int_tensor((3, 7168), torch.bfloat16, _stable_seed(call, r), "cpu") for r in range(world)]
            ).to(dev)
            assert torch.equal(out, expect), f"wrong sum at call {call}"
        time.sleep(0.5)  # the watchdog polls every 0.1 s
        warnings = [r.getMessage() for r in collect.records]
        if rank == world - 1:
            assert not warnings, f"the late rank itself waited for nobody, yet warned: {warnings}"
        else:
            assert len(warnings) == 1, f"expected one slow-wait warning, got {warnings}"
            text = warnings[0]
            assert f"call #{late_call}" in text and f"for rank {world - 1}" in text and "phase" in text, text
        assert ar.timeout_error() is None
    finally:
        package_log.removeHandler(collect)
        ar.close()


# --------------------------------------------------------------------------------------------------------
def _expect_probe_error(world, rank, spec, expected):
    """Construction with the probe-drop switch at `spec` fails on every rank with exactly the `expected` pairs:
    (sender, receiver, what, where), `what` and `where` parts of the pair's text."""
    for name, value in spelled_out("SGL_SM120_DEBUG_PROBE_DROP", spec + f"@{_memory()}").items():
        os.environ[name] = value  # the switch leaves host memory alone unless told
    try:
        _make(world, rank, 64 * 7168, timeout_s=2.0)  # the probe's polls: min(5 s, timeout_s); arrivals take ms
    except IpcAllReduceProbeError as err:
        assert sorted(p[:2] for p in err.pairs) == sorted(e[:2] for e in expected), (spec, err.pairs)
        for sender, receiver, what, where in expected:
            (text,) = [p[2] for p in err.pairs if p[:2] == (sender, receiver) and what in p[2]]
            assert where in text, (spec, text)
            assert f"rank {sender} -> rank {receiver}" in str(err) and "ACS" in str(err), str(err)
    else:
        raise AssertionError(f"the probe did not notice {expected} ({spec})")
    finally:
        for name in spelled_out("SGL_SM120_DEBUG_PROBE_DROP", ""):
            os.environ.pop(name, None)


def _scenario_probe_drops(rank, world):
    """The debug switch breaks rank 1's probe on its path to rank 0: construction must fail on every rank naming
    each broken pair, which way the data went and the place, never end later in a timeout trap or wrong sums.
    Dropped writes (into every page, then into the slab's last page only: a mapping broken for part of a slab);
    corrupted peer loads, pull's data path, which carries no sentinels; both at once. A workspace built after each
    failure works, through push and pull, and the probe leaves its scratch clean."""
    dev = torch.device("cuda", torch.cuda.current_device())
    dropped = (1, 0, "write never arrived", "the flag area")  # the lowest failed place: the first page after Ctrl
    corrupted = (0, 1, "rank 1's loads from rank 0 returned wrong data", "the pull area of parity 0 (input copy)")
    cases = (("1:0:write", [dropped]),
             ("1:0:last", [(1, 0, "write never arrived", "the pull area of parity 1")]),
             ("1:0:read", [corrupted]),
             ("1:0", [dropped, corrupted]))
    for spec, expected in cases:
        _expect_probe_error(world, rank, spec, expected)
    ar = _make(world, rank, 64 * 7168)
    try:
        x = torch.ones(3, 7168, dtype=torch.bfloat16, device=dev)
        for transport in ("push", "pull"):
            out = ar.all_reduce(x, transport=transport)
            synchronize(ar)
            assert torch.equal(out, torch.full_like(x, world)), f"wrong {transport} sum after a failed probe"
        assert dirty_halves(ar) == 0, "the probe left scratch dirty"
    finally:
        ar.close()


# --------------------------------------------------------------------------------------------------------
# I6 (csrc/ar_protocol.cuh): one workspace's calls stay in the host's order whatever stream they come from.
SPIN_CYCLES = 2_000_000  # torch.cuda._sleep: about a millisecond, longer than a small call


def _stream_case(call: int, world: int, dev):
    """Call `call`'s inputs on every rank and its expected sum: a size of its own (rows 1..5 of 7168), so a call
    paired with another one's peer waits for packs that never come or sums the wrong data."""
    rows = call % 5 + 1
    inputs = [_int_tensor((rows, 7168), torch.bfloat16, _stable_seed("streams", call, r), dev) for r in range(world)]
    return inputs, reference_all_reduce(inputs)


def _scenario_two_streams_keep_the_call_order(rank, world, calls=40):
    """Calls alternate between two streams with no order between them from the caller, and rank 0 holds the first
    stream back with a spin kernel before each of its calls, so its second stream's calls would overtake them: the
    workspace orders each call after the previous stream's (I6), so every sum is exact on every rank, no wait times
    out, and the scratch is clean after them. SGL_SM120_DEBUG_NO_STREAM_ORDER, which drops that order, fails here
    (tests/gpu/test_negative_controls.py)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 64 * 7168, timeout_s=10.0, on_timeout="exit")
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    failures = []
    try:
        cases = [_stream_case(call, world, dev) for call in range(calls)]
        torch.cuda.synchronize()
        outputs = []
        for call, (inputs, _) in enumerate(cases):
            with torch.cuda.stream(streams[call % 2]):
                if rank == 0 and call % 2 == 0:
                    torch.cuda._sleep(SPIN_CYCLES)
                outputs.append(ar.all_reduce(inputs[rank]) if call % 3 else
                               ar.all_reduce_add_rmsnorm(inputs[rank], torch.zeros_like(inputs[rank]),
                                                         torch.ones(7168, dtype=torch.bfloat16, device=dev), EPS)[1])
        torch.cuda.synchronize()
        synchronize(ar)  # raises the timeout a wait recorded
        for call, ((_, expected), got) in enumerate(zip(cases, outputs, strict=True)):
            if not torch.equal(got, expected):
                failures.append(f"call {call} from stream {call % 2}: wrong sum")
        if dirty_halves(ar):
            failures.append("scratch not clean after the calls from two streams")
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


def _scenario_captured_calls_from_two_streams_keep_their_order(rank, world, calls=12, replays=5):
    """One graph whose calls alternate between its capture stream and a stream forked from it, with no order between
    the two branches from the caller (rank 0's capture-stream branch starts each call with a spin kernel): the
    workspace adds an edge from each call to the next (I6), so every replay's sums are exact on every rank."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 64 * 7168, timeout_s=10.0, on_timeout="exit")
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    failures = []
    try:
        static = [_stream_case(call, world, dev)[0][rank].clone() for call in range(calls)]
        with torch.cuda.stream(main):
            ar.all_reduce(static[0])  # the eager warm-up on the capture stream, as SGLang's
        torch.cuda.synchronize()
        graph, outputs = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph, stream=main):
            side.wait_stream(main)
            for call, x in enumerate(static):
                with torch.cuda.stream(main if call % 2 == 0 else side):
                    if rank == 0 and call % 2 == 0:
                        torch.cuda._sleep(SPIN_CYCLES)
                    outputs.append(ar.all_reduce(x))
            main.wait_stream(side)
        for replay in range(replays):
            expected = []
            for call, x in enumerate(static):
                inputs, want = _stream_case(call + 1000 * (replay + 1), world, dev)  # the same rows, fresh values
                x.copy_(inputs[rank])
                expected.append(want)
            graph.replay()
            torch.cuda.synchronize()
            synchronize(ar)
            failures += [f"replay {replay} call {call}: wrong sum" for call, (got, want)
                         in enumerate(zip(outputs, expected, strict=True)) if not torch.equal(got, want)]
        if dirty_halves(ar):
            failures.append("scratch not clean after the replays")
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


def _scenario_an_unorderable_call_is_refused_on_every_rank(rank, world):
    """An eager call from a second stream while the stream of the previous eager call captures a graph cannot be
    ordered after it (nothing recorded inside a capture can be waited for outside it): every rank refuses it with
    one error naming I6, at once, with no kernel launched, so no rank waits for another. The workspace then works:
    the graph's replay and eager calls from either stream are exact."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 64 * 7168, timeout_s=10.0, on_timeout="exit")
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    failures = []
    try:
        x = torch.full((3, 7168), rank + 1, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(x)  # given, so that the refused call allocates nothing during the capture
        expected = torch.full_like(x, world * (world + 1) // 2)
        with torch.cuda.stream(first):
            ar.all_reduce(x)  # the eager stream is `first`
        torch.cuda.synchronize()
        graph, refusal = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(graph, stream=first, capture_error_mode="relaxed"):
            captured = ar.all_reduce(x)
            with torch.cuda.stream(second):
                try:
                    ar.all_reduce(x, out)
                except RuntimeError as exc:
                    refusal = str(exc)
        every: list = [None] * world
        dist.all_gather_object(every, refusal)
        if not all(r and "I6" in r and "capturing a CUDA graph" in r for r in every):
            failures.append(f"the call was not refused on every rank: {every}")
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(captured, expected):
            failures.append("the captured call's replay is wrong")
        for stream in (second, first, second):
            with torch.cuda.stream(stream):
                got = ar.all_reduce(x)
            torch.cuda.synchronize()
            if not torch.equal(got, expected):
                failures.append("an eager call after the refusal is wrong")
        synchronize(ar)
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


# --------------------------------------------------------------------------------------------------------
def _scenario_device_counter(rank, world):
    """The counter /get_server_info reports: calls completed as the device counts them, CUDA-graph replays included
    (Python sees a captured call once), read without synchronizing the device."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = _make(world, rank, 64 * 7168)
    try:
        x = torch.ones(3, 7168, dtype=torch.bfloat16, device=dev)
        for _ in range(5):
            ar.all_reduce(x)
        synchronize(ar)
        assert ar.calls_completed() == 5, f"after 5 eager calls the device counted {ar.calls_completed()}"
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            ar.all_reduce(x)  # warm-up on the capture stream (one more eager call)
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(3):
                    out = ar.all_reduce(x)
        for _ in range(10):
            graph.replay()
        synchronize(ar)
        assert torch.equal(out, torch.full_like(x, world)), "wrong sum in the replayed graph"
        assert ar.calls_completed() == 5 + 1 + 3 * 10, f"device counted {ar.calls_completed()}, expected 36"
    finally:
        ar.close()


# --------------------------------------------------------------------------------------------------------
# The two-rank scenarios, test name -> (scenario, args), in the order they run; the trap last.
TWO_RANKS = {
    "test_exact_sums_all_shapes_schedules_dtypes": (_scenario_exact_shapes, (ROWS, HIDDENS, DTYPES)),
    "test_fused_every_cluster_size_and_the_cluster_check_fallback_give_the_same_bits":
        (_scenario_cluster_sizes_and_fallback, ()),
    "test_random_inputs_within_the_fp64_bound_and_special_values_exact": (_scenario_random_and_special_values, ()),
    "test_back_to_back_calls_alternating_sizes": (_scenario_back_to_back, (300,)),
    "test_graph_of_mixed_calls_replayed_with_fresh_inputs": (_scenario_graph, (31, 12)),
    "test_create_close_cycles_with_and_without_a_delayed_peer_leak_nothing": (_scenario_create_close, (24,)),
    "test_late_peer_is_waited_for_and_warned_about_not_an_error": (_scenario_late_peer, (3, 3.0)),
    "test_probe_names_a_dropped_write_and_a_corrupted_read_on_every_rank": (_scenario_probe_drops, ()),
    "test_device_call_counter_counts_graph_replays": (_scenario_device_counter, ()),
    "test_calls_from_two_streams_keep_the_host_s_order": (_scenario_two_streams_keep_the_call_order, ()),
    "test_captured_calls_from_two_streams_keep_their_order": (
        _scenario_captured_calls_from_two_streams_keep_their_order, ()),
    "test_an_eager_call_that_cannot_be_ordered_is_refused_on_every_rank": (
        _scenario_an_unorderable_call_is_refused_on_every_rank, ()),
    "test_rank_skipping_a_call_ends_in_timeout_error_exit_mode": (_scenario_rank_skips_a_call, ("exit",)),
    "test_rank_skipping_a_call_ends_in_timeout_error_not_hang": (_scenario_rank_skips_a_call, ("trap",)),
}


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    with spawn_env(tmp_path_factory):
        return run_scenarios(2, selected_scenarios(request, TWO_RANKS), timeout_s=600)


def passed(outcomes: dict, request) -> None:
    failure = outcomes[request.node.name]
    assert failure is None, failure


@need_ranks(2)
def test_exact_sums_all_shapes_schedules_dtypes(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_fused_every_cluster_size_and_the_cluster_check_fallback_give_the_same_bits(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_random_inputs_within_the_fp64_bound_and_special_values_exact(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_back_to_back_calls_alternating_sizes(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_graph_of_mixed_calls_replayed_with_fresh_inputs(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_create_close_cycles_with_and_without_a_delayed_peer_leak_nothing(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_late_peer_is_waited_for_and_warned_about_not_an_error(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_probe_names_a_dropped_write_and_a_corrupted_read_on_every_rank(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_device_call_counter_counts_graph_replays(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_calls_from_two_streams_keep_the_host_s_order(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_captured_calls_from_two_streams_keep_their_order(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_an_eager_call_that_cannot_be_ordered_is_refused_on_every_rank(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_rank_skipping_a_call_ends_in_timeout_error_exit_mode(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
def test_rank_skipping_a_call_ends_in_timeout_error_not_hang(two_ranks, request):
    passed(two_ranks, request)


@need_ranks(2)
@pytest.mark.parametrize("world", [4, 8])
def test_rank_skipping_a_call_ends_in_timeout_error_on_every_rank_exit_mode(world):
    """At 4 and 8 ranks each waiting rank raises (exit mode: no trap to be lost when several processes share one
    GPU), and the workspace refuses the next call."""
    run_ranks(world, _scenario_rank_skips_a_call, "exit", timeout_s=240)


@need_ranks(2)
@pytest.mark.parametrize("world", [4, 8])
def test_exact_sums_oversubscribed(world):
    """4 and 8 ranks on the GPUs there are (ranks share GPUs): the 4/8-rank schedules' index arithmetic and the
    island exchange, for correctness only."""
    run_ranks(world, _scenario_exact_shapes, [1, 3, 64], [7168, 8], [torch.bfloat16], 30.0, timeout_s=600)
