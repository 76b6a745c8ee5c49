"""The dispatch policy as data (sgl_kernel_sm120/policy.py): the kernel limits as the built library reports them
and as the policy uses them, routes and their ids, what a workspace runs, the seeds."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from sgl_kernel_sm120 import _ext, policy
from sgl_kernel_sm120.policy import Link, Memory, Route, Transport, Variant, WorkspaceShape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = policy.kernel_limits()


def _header_constants() -> dict[str, int]:
    """The integer constants of csrc/ar_types.h and csrc/ar_launch.h, evaluated in the order they are written."""
    values: dict[str, int] = {}
    for name in ("ar_types.h", "ar_launch.h"):
        with open(os.path.join(REPO, "csrc", name)) as handle:
            for const, expr in re.findall(r"constexpr (?:int|long long) (k\w+) =\s*([^;]+);", handle.read()):
                expr = re.sub(r"static_cast<long long>\((\w+)\)", r"\1", expr)
                values[const] = int(eval(expr, {}, dict(values)))  # noqa: S307 - our own header's arithmetic
    return values


# ------------------------------------------------------------------------------------------- kernel limits
def test_the_library_reports_the_constants_of_the_sources_it_was_built_from():
    raw = json.loads(_ext.ops().kernel_limits())
    header = _header_constants()
    assert raw["plain_max_threads"] == header["kPlainMaxThreads"]
    assert raw["max_packs_per_thread"] == header["kMaxPacksPerThread"]
    assert raw["max_fused_hidden"] == header["kMaxFusedHidden"]
    assert raw["max_world"] == header["kMaxWorld"] and raw["max_ctas"] == header["kMaxCounters"]
    assert raw["pack_bytes"] == header["kPackBytes"] and raw["elems_per_pack"] == header["kElemsPerPack"]
    assert raw["owner_block_packs"] == header["kOwnerBlockPacks"]
    assert LIMITS == policy.parse_kernel_limits(json.dumps(raw))


def test_the_enums_mirror_the_librarys_codes():
    """A mismatch would launch another variant, transport or memory than the one asked for."""
    raw = json.loads(_ext.ops().kernel_limits())
    assert {v.name.lower(): int(v) for v in Variant} == {
        k[len("variant_"):]: v for k, v in raw.items() if k.startswith("variant_")}
    assert {t.value: t.code for t in Transport} == {
        k[len("transport_"):]: v for k, v in raw.items() if k.startswith("transport_")}
    assert {m.value: m.code for m in Memory} == {
        k[len("memory_"):]: v for k, v in raw.items() if k.startswith("memory_")}


def test_a_library_built_from_other_sources_is_refused_by_name():
    raw = json.loads(_ext.ops().kernel_limits())
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
    assert Route.parse("TWOSHOT/pull/host/t256") == Route(Variant.TWOSHOT, Transport.PULL, Memory.HOST, threads=256)
    staged = Route("ONESHOT", "staged", "device", ctas=32, threads=128, window=7)
    assert staged.id == "ONESHOT/staged/device/b32/t128/w7" and Route.parse(staged.id) == staged
    assert Route(0, "push", "device") == Route(Variant.ONESHOT)  # by code, by name, by member


@pytest.mark.parametrize("fields, message", [
    ({"variant": "FOURSHOT"}, "unknown variant"),
    ({"transport": "carrier"}, "unknown transport"),
    ({"memory": "gpu"}, "unknown memory"),
    ({"ctas": 0}, "ctas 0: a positive number"),
    ({"ctas": True}, "ctas True"),
    ({"ctas": 2.5}, "ctas 2.5"),
    ({"cluster": 3}, "cluster 3"),
    ({"variant": "TWOSHOT", "cluster": 4}, "cluster 4"),
    ({"ctas": 2, "cluster": 4}, "ctas 2 cannot hold one cluster of 4"),
    ({"threads": 100}, "whole warps"),
    ({"window": 0}, "window 0: a positive number"),
    ({"transport": "push", "window": 2}, "only staged push runs its passes in a window"),
])
def test_a_route_the_kernels_cannot_launch_is_refused_when_made(fields, message):
    with pytest.raises(ValueError, match=message):
        Route(**{"variant": "ONESHOT", **fields})


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
def test_the_seeds_push_with_the_seed_variant_and_every_launch_field_by_its_rule():
    for world in (2, 4, 8):
        for link in (Link.PCIE, Link.NVLINK):
            shape = WorkspaceShape(world, "device", link, num_islands=2 if world == 8 else 1, sm_budget=188)
            for nbytes in (16, 43008, 1 << 20):
                route = policy.seed_route(nbytes, shape)
                assert route == Route(policy.choose_variant(nbytes, world, link, shape.num_islands),
                                      policy.SEED_TRANSPORT, "device")
                assert policy.refusal(shape, route, nbytes, fused=False, limits=LIMITS) is None
    host = WorkspaceShape(8, "host", "host", oneshot_max_bytes=policy.oneshot_max_bytes(8, Link.HOST))
    for nbytes in (16, 8192, 8208, 1 << 20):
        route = policy.seed_route(nbytes, host)
        assert route.memory is Memory.HOST and policy.refusal(host, route, nbytes, fused=True, limits=LIMITS) is None
    assert policy.seed_route(16, host, "pull").transport is Transport.PULL
    with pytest.raises(ValueError):
        policy.seed_route(-1, host)


# ---------------------------------------------------------------------------------- the workspace's calls
def test_the_keyword_forms_of_the_ops_are_the_seed_route_with_those_fields_replaced():
    from sgl_kernel_sm120.ipc_allreduce import IpcAllReduce

    ws = IpcAllReduce.__new__(IpcAllReduce)  # no GPU: the route a call would run, not the call
    ws._shape, ws.transport = RTX, "auto"

    class Inp:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def numel(self):
            return self.nbytes // 2

        def element_size(self):
            return 2

    seed = policy.seed_route(1 << 20, RTX)
    assert ws._route(Inp(1 << 20), None) == seed
    assert ws._route(Inp(1 << 20), None, variant=Variant.TWOSHOT, transport="staged", ctas=94) == \
        Route(Variant.TWOSHOT, Transport.STAGED, "device", ctas=94)
    given = Route("ONESHOT", "pull", "device", ctas=188, cluster=4)
    assert ws._route(Inp(1024), given) == given and ws._route(Inp(1024), given, cluster=2).cluster == 2
    ws.transport = "pull"  # the workspace's own transport for its seed routes
    assert ws._route(Inp(1024), None).transport is Transport.PULL
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="ctas"):
            ws._route(Inp(1024), None, ctas=bad)
    with pytest.raises(ValueError, match="transport must be"):
        ws._route(Inp(1024), None, transport="carrier-pigeon")


def test_a_launch_hands_the_route_to_the_ops_field_by_field(monkeypatch):
    """What reaches the C++ op is the route: its variant and transport codes, its CTA cap (or the seed cap on this
    workspace), its cluster, its plain CTA size (or the seed rule); the op's own checks are the wall behind."""
    import torch

    from sgl_kernel_sm120.ipc_allreduce import IpcAllReduce

    calls = []

    class Ops:
        def all_reduce(self, *args):
            calls.append(("plain", args[3:]))

        def all_reduce_add_rmsnorm(self, *args):
            calls.append(("fused", args[7:]))

    monkeypatch.setattr(_ext, "ops", lambda: Ops())
    ws = IpcAllReduce.__new__(IpcAllReduce)  # no GPU: the arguments of a launch, not the launch
    ws._handle, ws._shape, ws.use_pdl, ws._watchdog, ws.limits = 1, RTX, True, None, LIMITS
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    ws.launch(Route("TWOSHOT", "pull", "device", ctas=94, threads=128), x)
    ws.launch(Route("ONESHOT", "staged", "device"), x)
    ws.launch_fused(Route("ONESHOT", "push", "device", ctas=188, cluster=4), x, x, torch.ones(64, dtype=x.dtype), 1e-6)
    ws.launch_fused(Route("ISLAND", "staged", "device", window=3), x, x, torch.ones(64, dtype=x.dtype), 1e-6)
    staged_threads = policy.plain_threads(x.numel() * 2, Transport.STAGED)
    assert calls == [  # the window last: 0 asks for the kernels' default
        ("plain", (int(Variant.TWOSHOT), 128, 94, True, Transport.PULL.code, 0)),
        ("plain", (int(Variant.ONESHOT), staged_threads, 188, True, Transport.STAGED.code, 0)),
        ("fused", (int(Variant.ONESHOT), 188, True, 4, Transport.PUSH.code, 0)),
        ("fused", (int(Variant.ISLAND), 188, True, 0, Transport.STAGED.code, 3)),
    ]
