"""GPU tests of the transports: push, staged push and pull give the same bits, in both ways ranks run
on one GPU.

- Processes sharing the GPU (tests.gpu.harness.run_ranks, SGL_SM120_TEST_SHARE_GPUS=1): the real IPC paths, the
  probe, host memory; but the ranks time-slice and never run at once, so a race in a flag protocol cannot show.
- One process running the whole group (benchmarks.harness.local_group): W workspaces seeing each other's
  slabs, each rank's calls on a stream of its own, or W parallel branches of one CUDA graph: the ranks' kernels run
  concurrently. The transports' negative controls (a flag published before its data, a staged pass dropped)
  are caught here.

Inputs are small integers (exact in bf16/fp16 and fp32, whatever the order), so every result is compared with the
exact sum bit for bit, and every transport's bits with push's for the same inputs (the norm included: the sum of
squares runs in one fixed order whatever the transport). Timeouts run in exit mode: a protocol fault ends in
IpcAllReduceTimeoutError or a wrong result, never a hang.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

from benchmarks.harness.local_group import close_local_group, local_group
from sgl_kernel_sm120 import (
    IpcAllReduce,
    IpcAllReduceTimeoutError,
    Schedule,
    reference_all_reduce,
    reference_all_reduce_add_rmsnorm,
)
from sgl_kernel_sm120.settings import VARIABLES
from tests.gpu.harness import (
    dirty_halves,
    need_ranks,
    run_ranks,
    shared_cluster_cache,  # noqa: F401 - a fixture
    synchronize,
)
from tests.gpu.test_ipc_allreduce import EPS, ULP, _int_tensor, _make, _same_on_all_ranks, _stable_seed
from tests.support.env import spelled_out

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("shared_cluster_cache")]

TRANSPORTS = ("push", "staged", "pull")
ROWS = (1, 3, 64, 257)
HIDDENS = (7168, 2048, 8)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _islands(world: int, memory: str):
    if memory == "host" or world < 4:
        return None
    return [list(range(world // 2)), list(range(world // 2, world))]


def _schedules(world: int, memory: str):
    if world < 2:
        return [Schedule.ONESHOT]
    if memory == "host" or world < 4:
        return [Schedule.ONESHOT, Schedule.TWOSHOT]
    return [Schedule.ONESHOT, Schedule.TWOSHOT, Schedule.ISLAND]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16).clone()


def _case_inputs(world, rows, hidden, dtype, seed, dev):
    inputs = [_int_tensor((rows, hidden), dtype, seed + r, dev) for r in range(world)]
    residual = _int_tensor((rows, hidden), dtype, seed + 1000, dev)
    weight = _int_tensor((hidden,), dtype, seed + 2000, dev, 1, 4)
    return inputs, residual, weight


def _check_case(tag, got_plain, got_fused, inputs, residual, weight, dtype, failures):
    expected = reference_all_reduce(inputs)
    ref_norm, ref_res = reference_all_reduce_add_rmsnorm(inputs, residual, weight, EPS)
    if not torch.equal(got_plain, expected):
        failures.append(f"{tag}: all_reduce differs in {(got_plain != expected).sum().item()} elements")
    if not torch.equal(got_fused[1], ref_res):
        failures.append(f"{tag}: residual_out differs in {(got_fused[1] != ref_res).sum().item()} elements")
    tol = ULP[dtype] * ref_norm.float().abs() + 1e-6
    bad = ((got_fused[0].float() - ref_norm.float()).abs() > tol).sum().item()
    if bad:
        failures.append(f"{tag}: norm_out off by more than 1 ulp in {bad} elements")


# --------------------------------------------------------------------------------------------------------
# Processes sharing the GPU.
def _scenario_every_transport(rank, world, memory):
    dev = torch.device("cuda", torch.cuda.current_device())
    ar = IpcAllReduce(dist.group.WORLD, dev, max(ROWS) * max(HIDDENS), islands=_islands(world, memory),
                      memory=memory, timeout_s=30.0, on_timeout="exit")
    failures = []
    try:
        for dtype, rows, hidden, schedule in itertools.product((torch.bfloat16, torch.float16), ROWS, HIDDENS,
                                                               _schedules(world, memory)):
            if schedule is Schedule.ONESHOT and rows * hidden > ar.oneshot_max_numel:
                continue  # host memory at 4 and 8 ranks: one-shot serves small calls only
            inputs, residual, weight = _case_inputs(world, rows, hidden, dtype,
                                                    _stable_seed("transports", rows, hidden, str(dtype)), dev)
            bits = {}
            for transport in TRANSPORTS:
                tag = f"{memory} {dtype} [{rows}, {hidden}] {schedule.name} {transport}"
                plain = ar.all_reduce(inputs[rank], schedule=schedule, transport=transport)
                fused = ar.all_reduce_add_rmsnorm(inputs[rank], residual, weight, EPS, schedule=schedule,
                                                  transport=transport)
                _check_case(tag, plain, fused, inputs, residual, weight, dtype, failures)
                bits[transport] = (_bits(plain), _bits(fused[0]), _bits(fused[1]))
                if not _same_on_all_ranks(fused[0]):
                    failures.append(f"{tag}: norm_out is not bitwise identical across ranks")
            for transport in TRANSPORTS[1:]:
                if not all(torch.equal(a, b) for a, b in zip(bits["push"], bits[transport], strict=True)):
                    failures.append(f"{memory} {dtype} [{rows}, {hidden}] {schedule.name}: {transport}'s bits "
                                    "differ from push's")
        err = ar.timeout_error()
        if err is not None:
            failures.append(str(err))
        if dirty_halves(ar):
            failures.append("push scratch not clean after the sweep")
    finally:
        ar.close()
    assert not failures, "\n".join(failures[:20])


@need_ranks(2)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_transport_exact_and_same_bits_processes_sharing_the_gpu(world):
    run_ranks(world, _scenario_every_transport, "device", timeout_s=300)


@need_ranks(2)
@pytest.mark.parametrize("world", [2, 4])
def test_every_transport_exact_and_same_bits_in_host_memory(world, monkeypatch):
    before = set(os.listdir("/dev/shm"))
    run_ranks(world, _scenario_every_transport, "host", timeout_s=300)
    assert not set(os.listdir("/dev/shm")) - before


# --------------------------------------------------------------------------------------------------------
# Pull's readiness names the call (csrc/transports/pull.cuh P3): a flag wait is for its own call's counter exactly.
def _scenario_pull_rank_skips_call_one(rank, world, how):
    """Call #1 forced to pull. how="call": the last rank never makes it (nor any later call). how="ctas": the last
    rank makes it on one CTA where its peers launch several, so its other CTAs skip call #1, and then makes call #2 as
    usual. Either way every other rank must end in IpcAllReduceTimeoutError naming the last rank and call #1: with
    flags compared by >=, the skipped CTAs' waits would have taken call #2's counter and the call ended with no
    error. With "ctas" the last rank then waits in its call #2 for peers that gave up: a timeout naming call #2."""
    dev = torch.device("cuda", torch.cuda.current_device())
    skipper = world - 1
    ar = _make(world, rank, 64 * 7168, timeout_s=1.0, on_timeout="exit")
    cols = 7168 if ar.oneshot_max_numel >= 3 * 7168 else 1024  # host memory: a smaller one-shot bound
    x = torch.ones(3, cols, dtype=torch.bfloat16, device=dev)
    out = ar.all_reduce(x, schedule=Schedule.ONESHOT, transport="pull")
    synchronize(ar)
    assert torch.equal(out, torch.full_like(x, world)), "call #0 gave a wrong sum"
    dist.barrier()
    failure = None
    # Whatever happens, every rank reaches the barrier below (see _scenario_rank_skips_a_call).
    try:
        if rank != skipper:
            ar.all_reduce(x, schedule=Schedule.ONESHOT, transport="pull")
            try:
                synchronize(ar)
            except IpcAllReduceTimeoutError as err:
                assert err.rank == rank and err.peer == skipper and err.seq == 1, f"wrong details: {err}"
                assert f"rank {skipper}" in str(err) and "call #1" in str(err), str(err)
            else:
                raise AssertionError(f"call #1, which rank {skipper} skipped ({how}), completed instead of timing out")
        elif how == "ctas":
            ar.all_reduce(x, schedule=Schedule.ONESHOT, transport="pull", ctas=1)
            ar.all_reduce(x, schedule=Schedule.ONESHOT, transport="pull")
            try:
                synchronize(ar)
            except IpcAllReduceTimeoutError as err:
                assert err.rank == rank and err.seq == 2, f"wrong details: {err}"
            else:
                raise AssertionError("call #2 completed although its peers had given up in call #1")
    except BaseException:  # noqa: B036 - reported after the barrier
        failure = traceback.format_exc()
    dist.barrier()
    ar.close(collective=False)
    assert failure is None, failure


@need_ranks(2)
@pytest.mark.parametrize("how", ["call", "ctas"])
@pytest.mark.parametrize("world", [2, 4])
def test_pull_rank_skipping_a_call_ends_in_timeout_error_naming_the_call(world, how):
    run_ranks(world, _scenario_pull_rank_skips_call_one, how, timeout_s=240)


# --------------------------------------------------------------------------------------------------------
# One process, the ranks concurrent.
def _local_group_sweep(world: int, rows_list, hiddens, calls_per_graph: int, replays: int) -> list[str]:
    """Eager calls on a stream per rank, then a CUDA graph of W parallel branches of mixed calls (every transport
    and schedule), replayed with fresh inputs. Returns the failures."""
    dev = torch.device("cuda", torch.cuda.current_device())
    comms = local_group(dev, world, max(rows_list) * max(hiddens), islands=_islands(world, "device"), timeout_s=10.0)
    streams = [torch.cuda.Stream() for _ in range(world)]
    failures = []
    try:
        cases = list(itertools.product(rows_list, hiddens, _schedules(world, "device"), TRANSPORTS))
        # Eager: each rank's call on its own stream, all launched before any is waited for. Call-major (every
        # rank's plain call, then every rank's fused one): see benchmarks/harness/local_group.py on lazy loading.
        for rows, hidden, schedule, transport in cases:
            inputs, residual, weight = _case_inputs(world, rows, hidden, torch.bfloat16,
                                                    _stable_seed("local", rows, hidden), dev)
            torch.cuda.synchronize()
            plain, fused = [None] * world, [None] * world
            for r, comm in enumerate(comms):
                with torch.cuda.stream(streams[r]):
                    plain[r] = comm.all_reduce(inputs[r], schedule=schedule, transport=transport)
            for r, comm in enumerate(comms):
                with torch.cuda.stream(streams[r]):
                    fused[r] = comm.all_reduce_add_rmsnorm(inputs[r], residual, weight, EPS, schedule=schedule,
                                                           transport=transport)
            torch.cuda.synchronize()
            tag = f"local W={world} [{rows}, {hidden}] {schedule.name} {transport}"
            for r in range(world):
                _check_case(f"{tag} rank {r}", plain[r], fused[r], inputs, residual, weight, torch.bfloat16, failures)
            if any(not torch.equal(_bits(fused[0][0]), _bits(f[0])) for f in fused[1:]):
                failures.append(f"{tag}: norm_out differs across ranks")
            if failures:
                break
        # A graph of W parallel branches, each rank's calls in order on its branch.
        plan = [cases[(7 * i) % len(cases)] for i in range(calls_per_graph)]
        static = []
        for i, (rows, hidden, _schedule, _transport) in enumerate(plan):
            inputs, residual, weight = _case_inputs(world, rows, hidden, torch.bfloat16, 7919 * i, dev)
            static.append(([x.clone() for x in inputs], residual.clone(), weight.clone()))
        torch.cuda.synchronize()
        outputs = [[None] * len(plan) for _ in range(world)]
        main = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=main):
            for s in streams:
                s.wait_stream(main)
            for r, comm in enumerate(comms):
                with torch.cuda.stream(streams[r]):
                    for i, (_rows, _hidden, schedule, transport) in enumerate(plan):
                        x, residual, weight = static[i][0][r], static[i][1], static[i][2]
                        if i % 2:
                            outputs[r][i] = comm.all_reduce(x, schedule=schedule, transport=transport)
                        else:
                            outputs[r][i] = comm.all_reduce_add_rmsnorm(x, residual, weight, EPS, schedule=schedule,
                                                                        transport=transport)
            for s in streams:
                main.wait_stream(s)
        for replay in range(replays):
            expected = []
            for i, (rows, hidden, _schedule, _transport) in enumerate(plan):
                inputs, residual, weight = _case_inputs(world, rows, hidden, torch.bfloat16,
                                                        7919 * i + 100003 * (replay + 1), dev)
                for r in range(world):
                    static[i][0][r].copy_(inputs[r])
                static[i][1].copy_(residual)
                static[i][2].copy_(weight)
                if i % 2:
                    expected.append(reference_all_reduce(inputs))
                else:
                    expected.append(reference_all_reduce_add_rmsnorm(inputs, residual, weight, EPS)[1])
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            for r in range(world):
                for i, exp in enumerate(expected):
                    got = outputs[r][i] if i % 2 else outputs[r][i][1]
                    if not torch.equal(got, exp):
                        failures.append(f"local W={world} replay {replay} rank {r} call {i} {plan[i]} wrong")
            if failures:
                break
        del graph
        _group_left_clean(comms, "the local group's calls", failures)
    finally:
        close_local_group(comms)
    return failures


def _group_left_clean(comms, after: str, failures: list[str]) -> None:
    """After a local group's calls: no rank timed out, and its push scratch is empty again (I4)."""
    for comm in comms:
        err = comm.timeout_error()
        if err is not None:
            failures.append(f"timed out: {err}")
    if dirty_halves(comms[0]):
        failures.append(f"push scratch not clean after {after}")


@pytest.mark.gpu(1)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_transport_exact_with_the_ranks_running_concurrently(world):
    failures = _local_group_sweep(world, (1, 3, 64), (7168, 8), calls_per_graph=24, replays=20)
    assert not failures, "\n".join(failures[:20])


def _check_shape_outputs(tag, outs, op, want, norm_bits, bits_of, failures) -> None:
    """Every rank's outputs of one call against the exact sum (plain), residual (fused, exact) and norm (1 ulp), and,
    where given, norm_out's bits against `norm_bits` (`bits_of` names whose)."""
    expected, ref_norm, ref_res = want
    tol = ULP[torch.bfloat16] * ref_norm.float().abs() + 1e-6
    for r, got in enumerate(outs):
        if op == "all_reduce":
            if not torch.equal(got, expected):
                failures.append(f"{tag} rank {r}: wrong sum")
            continue
        if not torch.equal(got[1], ref_res):
            failures.append(f"{tag} rank {r}: wrong residual_out")
        if ((got[0].float() - ref_norm.float()).abs() > tol).any():
            failures.append(f"{tag} rank {r}: norm_out off by more than 1 ulp")
        if norm_bits is not None and not torch.equal(_bits(got[0]), norm_bits):
            failures.append(f"{tag} rank {r}: norm_out bits differ from {bits_of}")


def _launch_shapes_sweep(world: int, rows_list=(1, 3, 64), hidden: int = 7168) -> list[str]:
    """Every launch shape benchmarks/bench_transports.py sweeps, with the ranks running concurrently: the plain
    one-shot's CTA sizes (32 .. 512 threads) per transport; staged push at several CTA caps and every window, plain and
    fused, every schedule; the fused one-shot at every cluster size per transport. Sums are exact (integer inputs);
    a window never changes a bit (staged_push.cuh S1, S4), nor does the transport at a given cluster size."""
    dev = torch.device("cuda", torch.cuda.current_device())
    comms = local_group(dev, world, max(rows_list) * hidden, islands=_islands(world, "device"), timeout_s=10.0)
    streams = [torch.cuda.Stream() for _ in range(world)]
    budget = comms[0].shape.sm_budget
    failures = []

    def run(op, inputs, residual, weight, threads=None, **kw):
        outs = [None] * world
        torch.cuda.synchronize()
        for r, comm in enumerate(comms):  # call-major (benchmarks/harness/local_group.py)
            with torch.cuda.stream(streams[r]):
                if op == "all_reduce":
                    outs[r] = comm.all_reduce(inputs[r], threads=threads, **kw)
                else:
                    outs[r] = comm.all_reduce_add_rmsnorm(inputs[r], residual, weight, EPS, **kw)
        torch.cuda.synchronize()
        return outs

    try:
        for rows in rows_list:
            inputs, residual, weight = _case_inputs(world, rows, hidden, torch.bfloat16,
                                                    _stable_seed("shapes", world, rows), dev)
            want = (reference_all_reduce(inputs), *reference_all_reduce_add_rmsnorm(inputs, residual, weight, EPS))

            def check(tag, outs, op, norm_bits=None, bits_of="", want=want):
                _check_shape_outputs(tag, outs, op, want, norm_bits, bits_of, failures)

            for transport, threads in itertools.product(TRANSPORTS, (32, 64, 128, 256, 512)):
                outs = run("all_reduce", inputs, residual, weight, threads, schedule=Schedule.ONESHOT,
                           transport=transport)
                check(f"W={world} [{rows}, {hidden}] plain {transport} {threads} threads", outs, "all_reduce")
            for op, schedule, ctas in itertools.product(("all_reduce", "all_reduce_add_rmsnorm"),
                                                         _schedules(world, "device"), sorted({1, 8, 16, budget})):
                ctas = min(ctas, budget)
                norm_bits = None
                for window in range(1, world):
                    tag = f"W={world} [{rows}, {hidden}] {op} {schedule.name} staged {ctas} CTAs window {window}"
                    outs = run(op, inputs, residual, weight, schedule=schedule, transport="staged", ctas=ctas,
                               window=window)
                    check(tag, outs, op, norm_bits, "window 1's")
                    if op != "all_reduce" and norm_bits is None:
                        norm_bits = _bits(outs[0][0])
            for cluster in (1, 2, 4, 8):
                norm_bits = None
                for transport in TRANSPORTS:
                    outs = run("all_reduce_add_rmsnorm", inputs, residual, weight, schedule=Schedule.ONESHOT,
                               transport=transport, cluster=cluster)
                    check(f"W={world} [{rows}, {hidden}] fused {transport} cluster {cluster}", outs,
                          "all_reduce_add_rmsnorm", norm_bits, "push's")
                    if norm_bits is None:
                        norm_bits = _bits(outs[0][0])
            if failures:
                break
        _group_left_clean(comms, "the launch-shape sweep", failures)
    finally:
        close_local_group(comms)
    return failures


@pytest.mark.gpu(1)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_swept_launch_shape_exact_with_the_ranks_running_concurrently(world):
    failures = _launch_shapes_sweep(world)
    assert not failures, "\n".join(failures[:20])


# The transports' negative controls: each build breaks one invariant of csrc/transports/ on purpose, and the
# concurrent sweep must fail (a wrong result, or a timeout in exit mode). Run in a child process: the broken
# library replaces the packaged one there (SGL_SM120_EXT_LIBRARY).
CHILD = """
import sys
from tests.gpu.test_transports import _local_group_sweep
failures = _local_group_sweep(int(sys.argv[1]), (1, 3, 64), (7168,), calls_per_graph=24, replays=40)
print("FAILURES:", len(failures))
print("\\n".join(failures[:5]))
sys.exit(1 if failures else 0)
"""


@pytest.mark.gpu(1)
@pytest.mark.parametrize("flag", ["SGL_SM120_DEBUG_FLAG_BEFORE_DATA", "SGL_SM120_DEBUG_STAGED_SKIP_PASS"])
def test_broken_transport_protocol_is_caught_with_the_ranks_running_concurrently(flag):
    from tests.gpu.negative_builds import PREBUILT_ENV, build_broken

    with tempfile.TemporaryDirectory() as scratch:
        library = build_broken(flag, os.environ.get(PREBUILT_ENV) or scratch)
        env = dict(os.environ, **spelled_out(VARIABLES["library"], library), PYTHONPATH=ROOT)
        done = subprocess.run([sys.executable, "-c", CHILD, "4"], env=env, capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
    report = done.stdout + done.stderr
    assert done.returncode != 0, f"{flag}: the broken protocol was not caught:\n{report[-3000:]}"
    assert "wrong" in report or "timed out" in report, report[-3000:]
