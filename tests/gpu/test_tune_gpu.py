"""The tune's plumbing end to end on a GPU: `python -m sglang_sm120.tune` -> the table in the cache -> a TP group's
workspace routing by it -> the activation line naming it; and the quick tune a starting server runs.

On one GPU the ranks share it (--share-gpu): NCCL refuses
two ranks on one device, so the tool's debug switch --debug-nccl-us stands in for NCCL's time and the table
says so; its timings mean nothing, only the plumbing is checked. With two GPUs the same tests run with the
real NCCL where noted. Exactness is checked for real either way: every candidate routed to passed the
tuner's verification.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from tests.gpu.harness import gpu_count, need_ranks, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN = 1024
WORLD = 2
TIMEOUT_S = 420


def tune_command(*extra: str, out: str | None = None) -> list[str]:
    """The tool as a launch runs it: under this environment's NCCL_* settings (--server-env), those of the groups
    these tests then build in this process."""
    share = ["--share-gpu"] if gpu_count() < WORLD else []
    return [sys.executable, "-m", "sglang_sm120.tune", "--hidden", str(HIDDEN), "--tp", str(WORLD), "--quick",
            "--max-batch", "4", "--draft-tokens", "1", "--server-env", *share, *extra] + (["--out", out] if out else [])


def tune_env(cache_dir: str, **extra: str) -> dict:
    return dict(os.environ, SGLANG_SM120_CACHE=cache_dir, **extra,
                PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")]))


def run_tune(cache_dir: str, *extra: str, out: str | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(tune_command(*extra, out=out), capture_output=True, text=True,
                          env=tune_env(cache_dir, **(env or {})), timeout=TIMEOUT_S)


def load_only_table(cache_dir: str):
    from sglang_sm120.routing import cache

    found = cache.find_tables(cache_dir)
    assert len(found) == 1 and found[0].ok, [(f.path, f.status, f.reason) for f in found]
    return found[0]


@pytest.mark.gpu
@need_ranks(WORLD)
def test_the_tool_writes_a_table_whose_every_routed_candidate_passed_verification(tmp_path):
    from sglang_sm120.routing.table import lookup, route_id

    injected = gpu_count() < WORLD
    done = run_tune(str(tmp_path), *(["--debug-nccl-us", "1000000"] if injected else []),
                    out=str(tmp_path / "copy.json"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    loaded = load_only_table(str(tmp_path))
    table = loaded.table
    assert table.quick and table.durations["measure"] > 0 and table.workload["hidden"] == HIDDEN
    assert set(table.measurements) == {(d, k) for d in ("bfloat16", "float16") for k in ("plain", "fused")}
    for (dtype, kind), points in table.measurements.items():
        for point in points:
            assert point.times or point.failed, (dtype, kind, point)
            assert any(e.low <= point.nbytes <= e.high for e in table.routes_for(dtype, kind)), (dtype, kind, point)
            route = lookup(table, point.nbytes, dtype, kind == "fused")  # None: NCCL
            assert route is None or route_id(route) in point.times, (dtype, kind, point, route)
    if injected:
        # NCCL "took" a second: every candidate that verified beats it, so ours serves somewhere
        assert any(e.route is not None for e in table.entries), table.to_dict()
        assert any(n.startswith("DEBUG: NCCL was not measured") for n in table.notes)
    assert json.loads((tmp_path / "copy.json").read_text())["key"] == table.key


def _group_worker(rank: int, world: int, cache_dir: str, tune: str, expect: str, memory: str = "device",
                  env: dict | None = None) -> None:
    import torch
    from torch.distributed.distributed_c10d import _get_default_store

    from sglang_sm120.core.config import ByteBound, OverlaySettings
    from sglang_sm120.runtime.backend import TPBackend

    os.environ.update(env or {})
    os.environ["SGLANG_SM120_CACHE"] = cache_dir
    lines = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("sglang_sm120").addHandler(Collect(level=logging.WARNING))
    device = torch.device("cuda", rank % torch.cuda.device_count())
    comm = TPBackend(name="tp:tune", ranks=list(range(world)), rank_in_group=rank, world_size=world, device=device,
                     deterministic=False, settings=OverlaySettings(mode="on", agreement_timeout_s=120.0),
                     store=_get_default_store())
    assert comm.resolve_gate().enabled, comm.decision
    bound = ByteBound(4 * HIDDEN * 2, "4 rows")
    built = comm.build(HIDDEN, torch.bfloat16, bound, kernel_timeout_s=30.0, tune=tune)
    if expect == "all-nccl":  # no table of this box: the ranks never measure, they name the command that does and
        # hold no workspace for a server that routes nothing to it
        assert not built and comm.workspace is None and comm.routes.source == "nccl", (built, comm.routes.source)
        assert "no routing table of this box" in comm.build_error, comm.build_error
        assert rank != 0 or any("ALL SIZES ON NCCL" in line for line in lines), lines
        assert rank != 0 or any("python -m sglang_sm120.tune --tp 2" in line for line in lines), lines
        return
    assert built, comm.build_error
    try:
        assert comm.routes.source == "table", (comm.routes.source, comm.routes.why)
        assert comm.memory == memory, (comm.memory, comm.memory_note)
        if rank == 0:
            enabled = [line for line in lines if "ENABLED" in line]
            assert len(enabled) == 1 and f"routes: tuned table {comm.routes.path}, measured " in enabled[0], lines
        x = torch.full((2, HIDDEN), float(rank + 1), dtype=torch.bfloat16, device=device)
        if expect == "ours":
            route = comm.route_for(x)
            assert route is not None, comm.routes.describe("bfloat16", bound.max_bytes)
            out = comm.run(x, route)
            torch.cuda.synchronize(device)
            assert torch.equal(out, torch.full_like(x, float(sum(range(1, world + 1))))), out
        elif expect == "nccl":
            assert comm.route_for(x) is None and 2 not in comm.fused_tokens, comm.routes.describe("bfloat16",
                                                                                          bound.max_bytes)
    finally:
        comm.close()


@pytest.mark.gpu
@need_ranks(WORLD)
@pytest.mark.parametrize("nccl_us, expect", [("1000000", "ours"), ("0.001", "nccl")])
def test_a_group_routes_by_the_tuned_table_and_its_line_names_it(tmp_path, nccl_us, expect):
    done = run_tune(str(tmp_path), "--debug-nccl-us", nccl_us, "--kinds", "plain,fused", "--dtype", "bf16")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    load_only_table(str(tmp_path))
    run_ranks(WORLD, _group_worker, str(tmp_path), "off", expect, timeout_s=TIMEOUT_S)


@pytest.mark.gpu
@need_ranks(WORLD)
def test_where_the_data_path_probe_fails_the_tune_measures_host_memory_and_the_server_routes_by_that_table(
        tmp_path):
    """P2P reported but its data not delivered (the probe-drop switch stands for ACS or a translating IOMMU): the
    tune's ranks build what a server's ranks build (core/plan.py), host memory, and measure it; the server's ranks
    fall back the same way, find that table and send sizes to our kernels through host memory."""
    drop = {"SGL_SM120_DEBUG_PROBE_DROP": "1:0"}  # device-memory workspaces only
    done = run_tune(str(tmp_path), "--debug-nccl-us", "1000000", "--kinds", "plain,fused", "--dtype", "bf16",
                    env=drop)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = load_only_table(str(tmp_path)).table
    assert table.key["memory"] == "host", table.key
    assert any("pinned host memory" in n and "probe failed" in n for n in table.notes), table.notes
    assert any(e.route is not None and e.route.memory.value == "host" for e in table.entries), table.to_dict()
    run_ranks(WORLD, _group_worker, str(tmp_path), "auto", "ours", "host", drop, timeout_s=TIMEOUT_S)


def _compute_pids() -> set[int]:
    """Processes holding a CUDA context on GPU 0, as the driver sees them."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()


def _tune_ranks() -> set[int]:
    """Live rank processes of any tune on this machine (their command line names the child module)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"sglang_sm120.tuning.child" in command and state != "Z":
            found.add(int(entry))
    return found


@pytest.mark.gpu
@need_ranks(WORLD)
def test_a_tune_killed_mid_measure_leaves_no_process_and_no_cuda_context_behind(tmp_path):
    """A launcher's SIGKILL of the tool, as the launcher sends it past its bound: the tool's rank processes (in
    sessions of their own) end with it, within 5 s, and with them their CUDA contexts."""
    before = _compute_pids()
    assert not _tune_ranks(), "another tune is running"
    tool = subprocess.Popen(tune_command("--debug-nccl-us", "1000000", "--verbose"), env=tune_env(str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = tool.stdout.readline()
            seen.append(line)
            if ": burst sm120/" in line or not line:  # rank 0 began a candidate: mid-measure
                break
        assert _tune_ranks() and tool.poll() is None, "".join(seen[-20:])
    finally:
        tool.kill()
        tool.wait(timeout=10)
    gone = time.monotonic() + 5
    while time.monotonic() < gone and (_tune_ranks() or _compute_pids() - before):
        time.sleep(0.1)
    assert not _tune_ranks(), f"rank processes outlived the tool: {_tune_ranks()}"
    assert not _compute_pids() - before, f"CUDA contexts left: {_compute_pids() - before} (before: {before})"


@pytest.mark.gpu
@need_ranks(WORLD)
def test_a_starting_group_without_a_table_sends_every_size_to_nccl_and_names_the_tune(tmp_path):
    # auto: the ranks only read tables (the launcher tunes before they start); none here
    run_ranks(WORLD, _group_worker, str(tmp_path), "auto", "all-nccl", timeout_s=TIMEOUT_S)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("world", [2, 8])
def test_the_one_process_tune_runs_the_ranks_concurrently_and_writes_only_its_out_file(tmp_path, world):
    """The whole group as local_group.local_group workspaces of one GPU (benchmarks/harness/local_tune.py), every
    candidate verified on every rank; the table goes to --out and never into the cache."""
    from sgl_kernel_sm120 import cluster_check
    from sglang_sm120.routing.table import RoutingTable, lookup, route_id

    out = tmp_path / "one_process.json"
    env = dict(os.environ, SGLANG_SM120_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.harness.local_tune", "--hidden", str(HIDDEN),
                           "--tp", str(world), "--max-rows", "4", "--debug-nccl-us", "1000000", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout[-4000:])  # the rendered table, kept in the junit XML
    # The workspaces' cluster-check verdict is cached per GPU and driver (sgl_kernel_sm120/cluster_check.py), as
    # in any process that builds a workspace; no routing table may land there.
    cached = set(os.listdir(tmp_path / "cache")) if (tmp_path / "cache").exists() else set()
    # (and its locks: the shared file's, and each GPU's own, cluster_check.verdict_for)
    assert all(name == cluster_check.CACHE_FILE or (name.startswith(cluster_check.CACHE_FILE + ".")
                                                    and name.endswith(".lock")) for name in cached), sorted(cached)
    table = RoutingTable.from_dict(json.loads(out.read_text()))
    assert table.key["world_size"] == world and any(n.startswith("one process") for n in table.notes)
    assert any(e.route is not None for e in table.entries), table.to_dict()  # NCCL "took" a second
    # every route of ours names the launch that was measured: its CTAs, and for the fused one-shot its cluster
    assert all(e.route.ctas is not None for e in table.entries if e.route is not None), table.to_dict()
    assert all(e.route.cluster is not None for e in table.entries
               if e.route is not None and e.kind == "fused" and e.route.schedule.name == "ONESHOT"), table.to_dict()
    assert all(m["timed"] == len(m["times"]) for m in table.to_dict()["measurements"])
    for (dtype, kind), points in table.measurements.items():
        for point in points:
            assert any(e.low <= point.nbytes <= e.high for e in table.routes_for(dtype, kind)), (dtype, kind, point)
            route = lookup(table, point.nbytes, dtype, kind == "fused")  # None: NCCL
            assert route is None or route_id(route) in point.times, (dtype, kind, point, route)


@pytest.mark.gpu(1)
@pytest.mark.parametrize("flag", ["SGL_SM120_DEBUG_NO_CLEAR"])
def test_a_debug_build_that_breaks_buffer_reuse_is_rejected_by_the_tuners_verification(tmp_path, flag):
    """The one-process tune (the ranks' kernels really run at once) on a build with one protocol invariant
    broken (tests/gpu/negative_builds.py): consumers that leave their packs in place (I4), so a later call
    finds the earlier call's packs already there. Every call gets inputs of its own and a burst of graph replays is
    checked, so a candidate of it fails its verification and is never routed to.

    Not SGL_SM120_DEBUG_SINGLE_BUFFER: its race needs a rank a whole call ahead of a peer that is still reading,
    which ranks time-slicing a GPU as processes produce (the negative control catches it there) and the lockstep
    ranks of one process did not: on an H200 its one-process tune rejected no candidate."""
    from sgl_kernel_sm120.settings import VARIABLES
    from sglang_sm120.routing.table import RoutingTable, route_id
    from tests.gpu.negative_builds import PREBUILT_ENV, build_broken
    from tests.support.env import spelled_out

    library = build_broken(flag, os.environ.get(PREBUILT_ENV) or str(tmp_path / "builds"))
    out = tmp_path / "broken.json"
    env = dict(os.environ, SGLANG_SM120_CACHE=str(tmp_path / "cache"), **spelled_out(VARIABLES["library"], library),
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.harness.local_tune", "--hidden", str(HIDDEN),
                           "--tp", "2", "--max-rows", "4", "--debug-nccl-us", "1000000", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout[-4000:])
    table = RoutingTable.from_dict(json.loads(out.read_text()))
    rejected = {cid: why for points in table.measurements.values() for p in points
                for cid, why in p.failed.items() if "verify:" in why}
    assert rejected, table.to_dict()
    timed = {cid for points in table.measurements.values() for p in points for cid in p.times}
    assert all(route_id(e.route) in timed for e in table.entries if e.route is not None)
