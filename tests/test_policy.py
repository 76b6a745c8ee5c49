"""The dispatch policy as data (sgl_kernel_sm120/policy.py): routes and their ids, what a workspace runs, the seeds,
resolution, the grids; and the library's limits, enum codes and grid rules against the policy's (those tests need
the built library; the others run on a KernelLimits literal)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from sgl_kernel_sm120 import _ext, policy
from sgl_kernel_sm120.policy import Link, Memory, Route, Schedule, Transport, WorkspaceShape, choose_schedule
from tests.fake_ops import LIMITS_JSON
from tests.host_check import build_host_check
from tests.test_build import _built_library

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = policy.parse_kernel_limits(json.dumps(LIMITS_JSON))


def _header_constants() -> dict[str, int | tuple[int, ...]]:
    """The integer constants (and constant arrays) of csrc/ar_types.h and csrc/ar_launch.h, evaluated in the order
    they are written."""
    values: dict[str, int | tuple[int, ...]] = {}
    for name in ("ar_types.h", "ar_launch.h"):
        with open(os.path.join(REPO, "csrc", name)) as handle:
            text = handle.read()
            for const, items in re.findall(r"constexpr int (k\w+)\[\] = \{([^}]*)\};", text):
                values[const] = tuple(int(v) for v in items.split(","))
            for const, expr in re.findall(r"constexpr (?:int|long long) (k\w+) =\s*([^;]+);", text):
                expr = re.sub(r"static_cast<long long>\((\w+)\)", r"\1", expr)
                values[const] = int(eval(expr, {}, dict(values)))  # noqa: S307 - our own header's arithmetic
    return values


# ------------------------------------------------------------------------------------------- kernel limits
def test_the_library_reports_the_constants_of_the_sources_it_was_built_from():
    _built_library()
    raw = json.loads(_ext.ops().kernel_limits())
    header = _header_constants()
    assert raw["plain_max_threads"] == header["kPlainMaxThreads"]
    assert raw["max_packs_per_thread"] == header["kMaxPacksPerThread"]
    assert raw["max_fused_hidden"] == header["kMaxFusedHidden"]
    assert raw["max_world"] == header["kMaxWorld"] and raw["max_ctas"] == header["kMaxCounters"]
    assert raw["pack_bytes"] == header["kPackBytes"] and raw["elems_per_pack"] == header["kElemsPerPack"]
    assert raw["owner_block_packs"] == header["kOwnerBlockPacks"]
    assert policy.kernel_limits() == policy.parse_kernel_limits(json.dumps(raw)) == LIMITS  # this file's literal
    assert (policy.WORLD_SIZES, policy.CLUSTER_SIZES) == (header["kWorldSizes"], header["kClusterSizes"])
    assert max(policy.WORLD_SIZES) == header["kMaxWorld"] and max(policy.CLUSTER_SIZES) == header["kMaxCluster"]


def test_the_enums_mirror_the_librarys_codes():
    """A mismatch would launch another schedule, transport or memory than the one asked for."""
    _built_library()
    raw = json.loads(_ext.ops().kernel_limits())
    assert {s.name.lower(): int(s) for s in Schedule} == {
        k[len("schedule_"):]: v for k, v in raw.items() if k.startswith("schedule_")}
    assert {t.value: t.code for t in Transport} == {
        k[len("transport_"):]: v for k, v in raw.items() if k.startswith("transport_")}
    assert {m.value: m.code for m in Memory} == {
        k[len("memory_"):]: v for k, v in raw.items() if k.startswith("memory_")}


def test_a_library_built_from_other_sources_is_refused_by_name():
    raw = dict(LIMITS_JSON)
    with pytest.raises(ValueError, match="transport_pull is 7 there, 2 here.*rebuild"):
        policy.parse_kernel_limits(json.dumps({**raw, "transport_pull": 7}))
    with pytest.raises(ValueError, match="lacks .*max_fused_hidden"):
        policy.parse_kernel_limits(json.dumps({k: v for k, v in raw.items() if k != "max_fused_hidden"}))


def test_the_policy_uses_the_limits_within_what_the_kernels_take():
    element_bytes = LIMITS.pack_bytes // LIMITS.elems_per_pack
    assert element_bytes == policy.ELEMENT_BYTES  # the element size the policy assumes is the kernels' pack math
    for nbytes in (16, 43008, policy.PLAIN_THREADS_TINY_BYTES, policy.PLAIN_THREADS_SWITCH_BYTES,
                   policy.PLAIN_THREADS_SWITCH_BYTES + 16, 1 << 26):
        for transport in Transport:
            threads = policy.plain_threads(nbytes, transport)
            assert threads <= LIMITS.plain_max_threads and threads % policy.THREAD_GRAIN == 0
    assert policy.STAGED_FEW_CTAS <= LIMITS.max_ctas and max(policy.WORLD_SIZES) == LIMITS.max_world


def test_the_seed_cta_size_follows_the_measured_sweep():
    """Push and pull: 64 threads up to 64 KiB, 128 up to 256 KiB; staged push 256 there (its sweep's size); 512
    past 256 KiB for all."""
    assert [policy.plain_threads(n) for n in (43008, 65536, 65552, 229376, 262144, 262160)] == [
        64, 64, 128, 128, 128, 512]
    assert policy.plain_threads(43008, "pull") == 64 and policy.plain_threads(43008, Transport.STAGED) == 256
    assert policy.plain_threads(1 << 20, "staged") == 512


def test_under_a_small_cta_cap_the_seed_cta_size_doubles_until_one_wave_holds_the_call():
    """The best launches of the one-process sweep (a W-th of an H200's SMs per rank) at bf16 [rows, 7168]: 256
    threads at W = 2 rows 16 (66 CTAs), 128 at W = 4 rows 3 (33), 512 at W = 4 rows 16, 256 at W = 8 rows 3 (16)."""
    row = 7168 * 2
    for rows, ctas, best in ((16, 66, 256), (3, 33, 128), (16, 33, 512), (3, 16, 256), (16, 16, 512)):
        assert policy.plain_threads(rows * row, "push", ctas=ctas, limits=LIMITS) == best, (rows, ctas)
    # where the seed's CTAs fit the cap already, the seed stays (a whole RTX PRO 6000, or an H200's 132 SMs)
    for rows in (1, 3, 16, 64):
        assert policy.plain_threads(rows * row, "pull", ctas=132, limits=LIMITS) == policy.plain_threads(rows * row)
    assert policy.plain_threads(1 << 26, "push", ctas=1, limits=LIMITS) == LIMITS.plain_max_threads
    for world in policy.WORLD_SIZES:
        for memory in Memory:
            numel = policy.oneshot_max_numel(world, memory, 458752 // 2, LIMITS)
            assert 0 < numel <= 458752 // 2 and numel % LIMITS.elems_per_pack == 0
    # the grid rule the tuner dedupes launches with stays within the cap and the kernels' CTA size
    assert policy.plain_grid(16, 188, 256, LIMITS) == 1
    assert policy.plain_grid(1 << 20, 188, 512, LIMITS) == (1 << 20) // LIMITS.pack_bytes // 512


def test_the_policy_s_grids_are_the_launches_own(tmp_path):
    """policy.plain_grid and fused_grid copy csrc/ar_launch.h's grid rules (plain_grid, fused_row_grid,
    fused_cluster_grid, which the launches use), for the tuner to time each grid once: held to the C++ over a table
    of inputs (cluster launches where the group holds every cluster the cap allows; routes hold ctas >= cluster)."""
    binary = build_host_check("launch_grid_check", tmp_path)
    plain = [(packs, threads, ctas) for packs in (1, 7, 31, 32, 33, 896, 2688, 28672, 1 << 20)
             for threads in (32, 64, 96, 256, 512, 1024) for ctas in (1, 3, 16, 94, 132, 188)]
    rows = [(rows, ctas) for rows in (1, 3, 16, 17, 257) for ctas in (1, 8, 132, 188)]
    clusters = [(rows, c, ctas) for rows in (1, 3, 16, 17, 257) for c in policy.CLUSTER_SIZES
                for ctas in (c, 8, 16, 31, 132, 188) if ctas >= c]
    queries = ([f"plain {p} {t} {c}" for p, t, c in plain] + [f"row {r} {c}" for r, c in rows]
               + [f"cluster {r} {c} {ctas} {1 << 20}" for r, c, ctas in clusters])
    done = subprocess.run([binary], input="\n".join(queries), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    theirs = [line.split()[0] for line in done.stdout.splitlines()]
    ours = ([str(policy.plain_grid(p * LIMITS.pack_bytes, c, t, LIMITS)) for p, t, c in plain]
            + [str(policy.fused_grid(r, c, 1)) for r, c in rows]
            + [str(policy.fused_grid(r, ctas, c)) for r, c, ctas in clusters])
    assert len(theirs) == len(queries)
    assert [(q, o, t) for q, o, t in zip(queries, ours, theirs, strict=True) if o != t] == []


def test_the_policy_needs_no_torch_until_the_limits_are_read():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import sgl_kernel_sm120.policy as p\n"
            "r = p.seed_route(1024, p.WorkspaceShape(8, 'device', 'pcie', num_islands=2, sm_budget=188))\n"
            "print(r.id)")
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ONESHOT/push/device", done.stderr


# ---------------------------------------------------------------------------------------------- routes
def test_a_route_names_every_field_that_changes_what_runs():
    route = Route("ONESHOT", "staged", "device", ctas=188, cluster=4)
    assert route.id == "ONESHOT/staged/device/b188/c4" and Route.parse(route.id) == route
    assert Route.parse("TWOSHOT/pull/host/t256") == Route(Schedule.TWOSHOT, Transport.PULL, Memory.HOST, threads=256)
    staged = Route("ONESHOT", "staged", "device", ctas=32, threads=128, window=7)
    assert staged.id == "ONESHOT/staged/device/b32/t128/w7" and Route.parse(staged.id) == staged
    assert Route(0, "push", "device") == Route(Schedule.ONESHOT)  # by code, by name, by member


@pytest.mark.parametrize("fields, message", [
    ({"schedule": "FOURSHOT"}, "unknown schedule"),
    ({"transport": "carrier"}, "unknown transport"),
    ({"memory": "gpu"}, "unknown memory"),
    ({"ctas": 0}, "ctas 0: a positive number"),
    ({"ctas": True}, "ctas True"),
    ({"ctas": 2.5}, "ctas 2.5"),
    ({"cluster": 3}, "cluster 3"),
    ({"schedule": "TWOSHOT", "cluster": 4}, "cluster 4"),
    ({"ctas": 2, "cluster": 4}, "ctas 2 cannot hold one cluster of 4"),
    ({"threads": 100}, "whole warps"),
    ({"window": 0}, "window 0: a positive number"),
    ({"transport": "push", "window": 2}, "only staged push runs its passes in a window"),
])
def test_a_route_the_kernels_cannot_launch_is_refused_when_made(fields, message):
    with pytest.raises(ValueError, match=message):
        Route(**{"schedule": "ONESHOT", **fields})


@pytest.mark.parametrize("text", ["ONESHOT/push", "ONESHOT/push/device/c4/b8", "ONESHOT/push/device/b8/b9",
                                  "ONESHOT/push/device/x1", "ONESHOT/push/device/b"])
def test_a_malformed_route_id_is_refused(text):
    with pytest.raises(ValueError, match="bad route|expected"):
        Route.parse(text)


# ------------------------------------------------------------------------------------ what a workspace runs
RTX = WorkspaceShape(8, "device", "pcie", num_islands=2, clusters=(2, 4), sm_budget=188)


@pytest.mark.parametrize("route, nbytes, fused, why", [
    (Route("ONESHOT", memory="host"), 1024, False, "a route of host memory; this workspace is in device memory"),
    (Route("ISLAND"), 1024, False, None),
    (Route("ONESHOT", cluster=8), 1024, True, "clusters of 8 CTAs are not launched by this workspace"),
    (Route("ONESHOT", cluster=4), 1024, True, None),
    (Route("ONESHOT", cluster=1), 1024, True, None),
    (Route("ONESHOT", cluster=4), 1024, False, "cluster: a plain call has no rows to spread"),
    (Route("ONESHOT", ctas=189), 1024, False, "189 CTAs: this workspace launches at most 188"),
    (Route("ONESHOT", threads=LIMITS.plain_max_threads), 1024, False, None),
    (Route("ONESHOT", threads=LIMITS.plain_max_threads * 2), 1024, False, "threads: the plain kernels take at most"),
    (Route("ONESHOT", threads=256), 1024, True, "the fused kernels size their own CTAs"),
    (Route("TWOSHOT", "staged"), 1 << 20, False, None),
    (Route("ONESHOT", "pull"), 1 << 20, True, None),
    (Route("ONESHOT", "staged", window=7), 1024, True, None),
    (Route("ONESHOT", "staged", window=8), 1024, False, "a window of 8 passes: 8 ranks make 7"),
])
def test_what_a_workspace_runs_as_the_route_says(route, nbytes, fused, why):
    found = policy.refusal(RTX, route, nbytes, fused=fused, limits=LIMITS)
    assert (found is None) if why is None else (found is not None and why in found), found


def test_islands_and_the_one_shot_bound_are_the_workspaces():
    flat = dataclasses.replace(RTX, num_islands=1)
    assert "ISLAND needs a workspace with islands" in policy.refusal(flat, Route("ISLAND"), 1024, fused=False,
                                                                     limits=LIMITS)
    host = WorkspaceShape(8, "host", "host", oneshot_max_bytes=8192, sm_budget=188)
    assert policy.refusal(host, Route("ONESHOT", memory="host"), 8192, fused=False, limits=LIMITS) is None
    assert "one-shot takes at most 8192 B" in policy.refusal(host, Route("ONESHOT", memory="host"), 8208,
                                                             fused=False, limits=LIMITS)


def test_the_cta_cap_is_the_routes_else_the_seed_cap():
    assert policy.cta_cap(Route("ONESHOT", ctas=94), RTX) == 94
    assert policy.cta_cap(Route("ONESHOT"), RTX) == 188
    assert policy.cta_cap(Route("ONESHOT", "staged"), RTX) == 188  # every transport on the whole budget
    small = dataclasses.replace(RTX, sm_budget=4)
    assert policy.cta_cap(Route("ONESHOT", "staged"), small) == 4


def test_a_shape_survives_its_dict_form():
    assert WorkspaceShape.from_dict(json.loads(json.dumps(RTX.as_dict()))) == RTX


# ---------------------------------------------------------------------------------------------- the seeds
def test_the_seeds_push_with_the_seed_schedule_and_leave_every_launch_field_to_its_rule():
    for world in (2, 4, 8):
        for link in (Link.PCIE, Link.NVLINK):
            shape = WorkspaceShape(world, "device", link, num_islands=2 if world == 8 else 1, sm_budget=188)
            for nbytes in (16, 43008, 1 << 20):
                route = policy.seed_route(nbytes, shape)
                assert route == Route(choose_schedule(nbytes, world, link, shape.num_islands),
                                      policy.SEED_TRANSPORT, "device")
                assert policy.refusal(shape, route, nbytes, fused=False, limits=LIMITS) is None
    host = WorkspaceShape(8, "host", "host", oneshot_max_bytes=policy.oneshot_max_bytes(8, Link.HOST))
    for nbytes in (16, 8192, 8208, 1 << 20):
        route = policy.seed_route(nbytes, host)
        assert route.memory is Memory.HOST and policy.refusal(host, route, nbytes, fused=True, limits=LIMITS) is None
    assert policy.seed_route(16, host, "pull").transport is Transport.PULL
    with pytest.raises(ValueError):
        policy.seed_route(-1, host)


def test_resolve_fills_the_launch_fields_the_ops_need_by_their_seed_rules():
    plain = policy.resolve(Route("ONESHOT"), 43008, RTX, LIMITS, False)
    assert (plain.ctas, plain.threads) == (188, policy.plain_threads(43008, "push", ctas=188, limits=LIMITS))
    assert plain.cluster is None and plain.window is None  # the kernels' own rules
    fused = policy.resolve(Route("ONESHOT", "staged"), 43008, RTX, LIMITS, True)
    assert (fused.ctas, fused.threads) == (188, None)  # the fused kernels size their own CTAs
    measured = Route("TWOSHOT", "pull", "device", ctas=94, threads=128)
    assert policy.resolve(measured, 1 << 20, RTX, LIMITS, False) is measured  # a measured launch stays as it is
    small = dataclasses.replace(RTX, sm_budget=16)
    assert policy.resolve(Route("ONESHOT"), 3 * 14336, small, LIMITS, False).threads == 256  # one wave on 16 CTAs


@pytest.mark.parametrize("nbytes", [0, 1024, 43008, 1 << 20, 64 << 20])
def test_two_ranks_always_use_one_shot(nbytes):
    assert choose_schedule(nbytes, 2, "nvlink") is Schedule.ONESHOT
    assert choose_schedule(nbytes, 2, "pcie", 2) is Schedule.ONESHOT


def test_nvlink_switches_to_two_shot_past_its_bound_and_pcie_to_islands_when_given():
    bound = policy.NVLINK_ONESHOT_MAX_BYTES
    assert choose_schedule(bound, 8, Link.NVLINK) is Schedule.ONESHOT
    assert choose_schedule(bound + 16, 8, Link.NVLINK) is Schedule.TWOSHOT
    for world in (4, 8):
        assert choose_schedule(1024, world, "pcie", 2) is Schedule.ONESHOT
        assert choose_schedule(1 << 20, world, "pcie", 2) is Schedule.ISLAND
        assert choose_schedule(1 << 20, world, "pcie", 1) is Schedule.TWOSHOT
    with pytest.raises(ValueError):
        choose_schedule(-1, 2, "pcie")
    with pytest.raises(ValueError, match="unknown link"):
        choose_schedule(8, 2, "infiniband")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("link", list(Link))
def test_the_one_shot_bound_is_where_the_seeds_stop_using_one_shot(world, link):
    limit = policy.oneshot_max_bytes(world, link)
    assert choose_schedule(limit, world, link) is Schedule.ONESHOT
    assert limit == policy.UNBOUNDED or choose_schedule(limit + 1, world, link) is not Schedule.ONESHOT


def test_the_schedule_is_described_size_range_by_size_range():
    bound = policy.PCIE_ONESHOT_MAX_BYTES[8]
    assert policy.describe_schedule(458752, 8, "pcie", 2) == f"ONESHOT up to {bound} B, ISLAND up to 458752 B"
    assert policy.describe_schedule(458752, 8, "pcie", 1) == f"ONESHOT up to {bound} B, TWOSHOT up to 458752 B"
    assert policy.describe_schedule(1 << 20, 2, "pcie") == f"ONESHOT up to {1 << 20} B"
    assert policy.describe_schedule(bound, 8, "pcie", 2) == f"ONESHOT up to {bound} B"
