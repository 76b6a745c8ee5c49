"""CPU tests of sgl_kernel_sm120: the references, the seed variants, island validation, argument checks, the
probe's and the watchdog's host side. The policy as data has its own file (tests/test_policy.py)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import sgl_kernel_sm120 as k
from sgl_kernel_sm120 import _ext, policy
from sgl_kernel_sm120 import data_path_probe as probe
from sgl_kernel_sm120.construction import placement, validate_islands
from sgl_kernel_sm120.env import spelled_out
from sgl_kernel_sm120.policy import Link, Variant, choose_variant


# ---------------------------------------------------------------------------------------------- references
def test_reference_all_reduce_accumulates_in_fp32_and_rounds_once():
    # 256 + 1 + 1 in bf16: pairwise bf16 rounding would give 256 + 1 -> 256, then 256 + 1 -> 256.
    a = torch.tensor([256.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    assert k.reference_all_reduce([a, b, b]).item() == 258.0
    assert k.reference_all_reduce([a, b, b]).dtype == torch.bfloat16


def test_reference_fused_matches_float64_formula():
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
    residual = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    weight = torch.randn(64, generator=g).to(torch.bfloat16)
    norm, res = k.reference_all_reduce_add_rmsnorm(inputs, residual, weight, 1e-6)
    summed = sum(t.double() for t in inputs) + residual.double()
    assert torch.equal(res, summed.float().to(torch.bfloat16))  # one rounding of the fp32 sum
    r = res.double()
    expected = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert torch.allclose(norm.double(), expected, rtol=2**-7, atol=1e-6)
    assert norm.dtype == res.dtype == torch.bfloat16


def test_reference_fused_norm_starts_from_rounded_residual():
    # The RMSNorm uses residual_out as stored (rounded), like SGLang's unfused add + RMSNorm; from the unrounded
    # fp32 sum the result differs in some elements, so this distinguishes the two.
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 256, generator=g).to(torch.bfloat16) for _ in range(4)]
    residual = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    weight = torch.randn(256, generator=g).to(torch.bfloat16)
    norm, res = k.reference_all_reduce_add_rmsnorm(inputs, residual, weight, 1e-6)

    def rmsnorm(x):
        return ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * weight.float()).to(torch.bfloat16)

    unrounded = sum(t.float() for t in inputs) + residual.float()
    assert torch.equal(norm, rmsnorm(res.float()))
    assert not torch.equal(norm, rmsnorm(unrounded))


# ----------------------------------------------------------------------------------------- variant choice
@pytest.mark.parametrize("nbytes", [0, 1024, 43008, 1 << 20, 64 << 20])
def test_two_ranks_always_use_one_shot(nbytes):
    assert choose_variant(nbytes, 2, "nvlink") is Variant.ONESHOT
    assert choose_variant(nbytes, 2, "pcie", 2) is Variant.ONESHOT


def test_nvlink_switches_to_two_shot_past_the_bound():
    bound = policy.NVLINK_ONESHOT_MAX_BYTES
    assert choose_variant(bound, 8, Link.NVLINK) is Variant.ONESHOT
    assert choose_variant(bound + 16, 8, Link.NVLINK) is Variant.TWOSHOT


@pytest.mark.parametrize("world", [4, 8])
def test_pcie_uses_islands_when_given_else_flat_two_shot(world):
    small, large = 1024, 1 << 20
    assert choose_variant(small, world, "pcie", 2) is Variant.ONESHOT
    assert choose_variant(large, world, "pcie", 2) is Variant.ISLAND
    assert choose_variant(large, world, "pcie", 1) is Variant.TWOSHOT


def test_choice_is_a_pure_function():
    calls = [
        (n, w, link, i) for n in (8, 43008, 1 << 22) for w in (2, 4, 8) for link in ("pcie", "nvlink") for i in (1, 2)
    ]
    forward = [choose_variant(*c) for c in calls]
    backward = [choose_variant(*c) for c in reversed(calls)][::-1]  # no answer depends on the calls before it
    assert forward == backward
    assert set(forward) == {Variant.ONESHOT, Variant.TWOSHOT, Variant.ISLAND}  # the calls reach every schedule
    with pytest.raises(ValueError):
        choose_variant(-1, 2, "pcie")
    with pytest.raises(ValueError):
        choose_variant(8, 2, "infiniband")


# ---------------------------------------------------------------------------------------------- islands
def test_islands_validation_and_placement():
    assert validate_islands(None, 8) is None
    assert validate_islands([[0, 1, 2, 3, 4, 5, 6, 7]], 8) is None  # one island = flat
    groups = validate_islands([[0, 2, 4, 6], [1, 3, 5, 7]], 8)
    assert placement(groups, 5) == ([1, 3, 5, 7], [4, 5], 1, 2)
    assert placement(groups, 0) == ([0, 2, 4, 6], [0, 1], 0, 0)
    with pytest.raises(ValueError, match="partition"):
        validate_islands([[0, 1, 2], [3, 4, 5, 6]], 8)
    with pytest.raises(ValueError, match="same size"):
        validate_islands([[0, 1, 2], [3, 4, 5, 6, 7]], 8)
    with pytest.raises(ValueError, match="partition"):
        validate_islands([[0, 1], [1, 2]], 4)


@pytest.mark.parametrize("num_packs", [1, 31, 2688, 4096, 4097])  # 2688: [3, 7168] bf16
def test_eight_rank_island_schedule_index_arithmetic(num_packs):
    """The island schedule's ownership on the CPU, as csrc/transports/push.cuh's HierStep computes it (owner: the
    pack's block of kOwnerBlockPacks, dealt round-robin over the island positions; offset: the owner's blocks one
    after the other) and with the chunk size csrc/workspace.cu gives each owner: every pack is reduced by exactly
    one owner per island, the owners are twins across islands, an owner's packs get distinct slots inside its
    chunk, and every rank receives each pack it does not own exactly once (from its island's owner)."""
    world, groups = 8, validate_islands([[0, 1, 2, 3], [4, 5, 6, 7]], 8)
    size = len(groups[0])
    block = policy.kernel_limits().owner_block_packs

    def owner(g):
        return (g // block) % size

    def offset(g):
        return (g // (block * size)) * block + g % block

    per_round = block * size
    chunk_packs = -(-num_packs // per_round) * block
    owners_of = {g: [] for g in range(num_packs)}
    position_of = {}
    for rank in range(world):
        members, twins, island, index = placement(groups, rank)
        assert twins[island] == rank
        position_of[rank] = (members, index)
        for g in range(num_packs):
            if owner(g) == index:
                owners_of[g].append(rank)
    for g, owners in owners_of.items():
        assert len(owners) == 2 and owners[1] - owners[0] == 4, (g, owners)  # one per island, twins
    for index in range(size):
        offs = [offset(g) for g in range(num_packs) if owner(g) == index]
        assert len(set(offs)) == len(offs) and (not offs or max(offs) < chunk_packs), (index, offs[-3:])
    received = {rank: {} for rank in range(world)}
    for g, owners in owners_of.items():
        for sender in owners:  # the all-gather: each owner pushes its result to the rest of its island
            members, _ = position_of[sender]
            for rank in members:
                if rank != sender:
                    received[rank][g] = received[rank].get(g, 0) + 1
    for rank in range(world):
        not_owned = {g for g, owners in owners_of.items() if rank not in owners}
        assert set(received[rank]) == not_owned and set(received[rank].values()) <= {1}, rank


# ----------------------------------------------------------------------------------------- argument checks
@pytest.fixture(scope="module")
def single_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"device": "cpu"}, "must be a CUDA device"),
        ({"dtype": torch.float32}, "bfloat16 or float16"),
        ({"max_numel": 12}, "multiple of 8"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"link": "ethernet"}, "link must be"),
        ({"on_timeout": "explode"}, "on_timeout must be"),
        ({"transport": "carrier-pigeon"}, "transport must be"),
    ],
)
def test_constructor_rejects_bad_arguments_clearly(single_rank_group, kwargs, message):
    args = {"device": "cuda:0", "max_numel": 1024, **kwargs}
    with pytest.raises(k.IpcAllReduceError, match=message):
        k.IpcAllReduce(single_rank_group, args.pop("device"), args.pop("max_numel"), **args)


def test_no_driver_or_gpu_is_named_as_such(single_rank_group, monkeypatch):
    """kernels_available() only says the library loads; without a driver the constructor says what is missing."""
    limits = policy.kernel_limits()
    monkeypatch.setattr(_ext, "ops", lambda: object())  # as if the kernels were built
    monkeypatch.setattr(policy, "kernel_limits", lambda: limits)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(k.IpcAllReduceError, match="no CUDA driver/GPU"):
        k.IpcAllReduce(single_rank_group, "cuda:0", 1024)


def test_launch_limits_are_agreed_on_the_smallest_gpu_and_every_cluster_check():
    """A group mixing two SKUs launches one grid shape everywhere (the smallest SM count and
    cluster capacity), and one rank whose cluster check failed takes clusters away from every rank."""
    from sgl_kernel_sm120.construction import agree_launch_limits

    big = {"sm": 170, "capacity": [85, 42, 21], "clusters_ok": True, "reason": "checked"}
    small = {"sm": 84, "capacity": [42, 21, 10], "clusters_ok": True, "reason": "checked"}
    agreed = agree_launch_limits([big, small])
    assert agreed == agree_launch_limits([small, big])  # the order of the ranks does not matter
    assert agreed["sm_budget"] == 84 and agreed["capacity"] == [42, 21, 10] and agreed["clusters"] == [2, 4, 8]
    failed = dict(small, clusters_ok=False, reason="the cluster check failed (exit code 1): illegal instruction")
    agreed = agree_launch_limits([big, failed])
    assert agreed["capacity"] == [0, 0, 0] and agreed["clusters"] == []
    assert agreed["reason"] == "rank 1: the cluster check failed (exit code 1): illegal instruction"
    assert agree_launch_limits([dict(big, capacity=[85, 0, 0])])["clusters"] == [2]


def test_host_workspace_is_sized_by_the_one_shot_it_serves():
    """At 8 ranks the host-memory workspace serves one-shot only up to HOST_ONESHOT_MAX_BYTES,
    so its one-shot slots are sized by that, not by the whole bound. The one-shot regions alone are 2 W^2 x bound
    (56 MiB at the 458,752 B bound, 2 parities x 8 slabs x 8 slots); sized by the 8 KiB one-shot range they
    shrink to 2 x 8 x the staged slots (18 chunks of bound / 8), so the whole buffer (with the pull areas and
    flags every slab also holds) is 40 MiB smaller. At 2 ranks one-shot serves everything."""
    from sgl_kernel_sm120.policy import Link, oneshot_max_bytes

    sized = _ext.ops().host_shared_bytes_for
    bound = 458752 // 2  # elements of 2 B
    uncapped = sized(8, bound, bound)
    capped = sized(8, bound, oneshot_max_bytes(8, Link.HOST) // 2)
    assert 2 * 8 * 8 * 458752 < uncapped < 70 * 2**20, uncapped
    assert uncapped - capped > 40 * 2**20, (capped, uncapped)
    assert sized(2, bound, min(bound, oneshot_max_bytes(2, Link.HOST) // 2)) == sized(2, bound, bound)
    assert sized(8, 2 * bound, 2 * bound) > uncapped  # a larger bound needs more
    with pytest.raises(RuntimeError, match="oneshot_max_numel <= max_numel"):
        sized(8, bound, 2 * bound)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("link", list(Link))
def test_one_shot_bound_is_where_choose_variant_stops_using_one_shot(world, link):
    from sgl_kernel_sm120.policy import oneshot_max_bytes

    limit = oneshot_max_bytes(world, link)
    assert choose_variant(limit, world, link) is Variant.ONESHOT
    if limit < 1 << 62:
        assert choose_variant(limit + 1, world, link) is not Variant.ONESHOT


def test_timeout_error_says_what_is_left_usable():
    trapped = k.IpcAllReduceTimeoutError(0, 3, "one-shot", 7, 1.5)
    assert "CUDA context of this process is no longer usable" in str(trapped) and trapped.context_lost
    exited = k.IpcAllReduceTimeoutError(0, 3, "one-shot", 7, 1.5, context_lost=False)
    assert "workspace is unusable" in str(exited) and "the CUDA context is not" in str(exited)
    assert "rank 3" in str(exited) and "call #7" in str(exited)


def test_missing_extension_raises_with_build_command(monkeypatch):
    monkeypatch.setattr(_ext, "_load", lambda: (None, _ext.BUILD_HINT))
    assert not k.kernels_available()
    with pytest.raises(k.KernelsNotBuiltError, match="pip install --no-build-isolation -e"):
        _ext.ops()


def test_library_for_another_torch_is_reported_as_that(tmp_path):
    import importlib.machinery

    from sgl_kernel_sm120 import _abi

    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    other = _abi.extension_module("1.99.0+cu118", "11.8")
    (tmp_path / (other + suffix)).write_bytes(b"")
    reason = _ext.missing_reason(str(tmp_path))
    assert "built for another torch (torch 1.99.0, CUDA 11.8)" in reason, reason
    assert f"this environment runs torch {torch.__version__.split('+')[0]}" in reason, reason
    assert "pip install --no-build-isolation -e" in reason, reason


def test_no_library_at_all_is_reported_as_not_built(tmp_path):
    reason = _ext.missing_reason(str(tmp_path))
    assert "are not built" in reason and _ext.expected_module() in reason, reason


def test_extension_name_carries_torch_and_cuda():
    from sgl_kernel_sm120 import _abi

    assert _abi.extension_module("2.14.1+cu130", "13.0") == "_C_torch2_14_1_cuda13_0"
    assert _abi.extension_module("2.11.0", "13.0") != _abi.extension_module("2.14.1", "13.0")
    assert _abi.describe_tag("_C_torch2_11_0_cuda13_0") == "torch 2.11.0, CUDA 13.0"


def test_extension_registers_every_op():
    ops = _ext.ops()
    for name in ("ws_create", "ws_open_peers", "ws_destroy", "ws_calls_completed", "all_reduce",
                 "all_reduce_add_rmsnorm"):
        assert hasattr(ops, name), name


def test_library_override_that_fails_to_load_says_so(monkeypatch, tmp_path):
    # The negative-control builds are loaded through this variable; a bad path must be a clear error.
    missing = tmp_path / "no_such_library.so"
    # `make test` loads its out-of-tree build this way; SGLang may have copied it to the other spelling
    for name in spelled_out(_ext.LIBRARY_OVERRIDE_ENV, ""):
        monkeypatch.setenv(name, str(missing))
    _ext._load.cache_clear()
    try:
        assert not k.kernels_available()
        with pytest.raises(k.KernelsNotBuiltError, match="no_such_library.so"):
            _ext.ops()
    finally:
        monkeypatch.undo()
        _ext._load.cache_clear()
    assert k.kernels_available()


def test_schedule_describes_every_size_once():
    from sgl_kernel_sm120.policy import PCIE_ONESHOT_MAX_BYTES, Variant, describe_schedule, schedule

    ranges = schedule(458752, 8, "pcie", num_islands=2)
    assert ranges == [(1, PCIE_ONESHOT_MAX_BYTES[8], Variant.ONESHOT),
                      (PCIE_ONESHOT_MAX_BYTES[8] + 1, 458752, Variant.ISLAND)]
    assert schedule(1 << 20, 2, "pcie") == [(1, 1 << 20, Variant.ONESHOT)]
    expected = f"ONESHOT up to {PCIE_ONESHOT_MAX_BYTES[8]} B, TWOSHOT up to 458752 B"
    assert describe_schedule(458752, 8, "pcie", 1) == expected


def test_slow_wait_record_is_read_whole_and_logged_once_per_call(caplog):
    import logging
    import time

    from sgl_kernel_sm120 import watchdog as mod

    error, slow = mod.ErrorRecord(), mod.SlowRecord()  # no GPU: the records in ordinary memory
    dog = mod.Watchdog(0, error, slow, timeout_s=300.0, on_timeout="exit", abort_after_s=0.0,
                       context_alive=lambda: True)
    assert ctypes_size(mod.SlowRecord) == 32  # struct SlowRecord in csrc/ar_types.h
    assert dog.slow_wait() is None and dog.timeout_error() is None
    caplog.set_level(logging.WARNING, logger="sgl_kernel_sm120.watchdog")
    dog.start()
    try:
        slow.rank, slow.peer, slow.phase, slow.waited_ns = 0, 1, 1, 5_500_000_000
        slow.call_plus_one = 8  # call #7, written last as the kernel does
        assert dog.slow_wait() == (7, 1, "one-shot", 5.5)
        time.sleep(0.8)
        slow.call_plus_one = 9
        time.sleep(0.8)
    finally:
        dog.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "call #7 has waited 5.5 s in the one-shot phase for rank 1" in messages[0], messages
    assert "call #8" in messages[1] and "IpcAllReduceTimeoutError only after 300 s" in messages[1], messages


def test_a_recorded_timeout_is_read_and_logged_and_the_records_are_let_go_before_they_are_freed(caplog):
    import logging
    import time

    from sgl_kernel_sm120 import watchdog as mod

    error, slow = mod.ErrorRecord(), mod.SlowRecord()
    dog = mod.Watchdog(2, error, slow, timeout_s=300.0, on_timeout="exit", abort_after_s=0.0,
                       context_alive=lambda: True)
    caplog.set_level(logging.ERROR, logger="sgl_kernel_sm120.watchdog")
    dog.start()
    try:
        error.rank, error.peer, error.phase, error.seq, error.waited_ns = 2, 5, 4, 11, 300_000_000_000
        error.flag = 1
        found = dog.timeout_error()
        assert isinstance(found, k.IpcAllReduceTimeoutError) and not found.context_lost
        assert (found.rank, found.peer, found.phase, found.seq) == (2, 5, "all-gather", 11)
        time.sleep(0.5)
    finally:
        dog.forget_records()
    assert dog.timeout_error() is None and dog.slow_wait() is None
    assert any("call #11 waited 300.00 s in the all-gather phase for rank 5" in r.getMessage()
               for r in caplog.records), caplog.records


def ctypes_size(struct) -> int:
    import ctypes

    return ctypes.sizeof(struct)


def test_probe_outcomes_name_the_failing_pairs():
    ok = [[1, 1], [1, 1]]
    assert probe.failed_pairs(ok) == []
    # row = receiver: rank 0 never got rank 1's pack, rank 1 got garbage from rank 0
    assert probe.failed_pairs([[1, 2], [3, 1]]) == [(1, 0, "write never arrived"), (0, 1, "wrong data arrived")]
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0"}) == 0
    assert probe.drop_target(0, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0"}) == -1
    assert probe.drop_target(0, {}) == -1
    # one round only: a mapping broken for part of the slab
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0:5"}, round_index=5) == 0
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0:5"}, round_index=4) == -1
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0"}, round_index=4) == 0
    with pytest.raises(ValueError, match="SRC:DST"):
        probe.drop_target(0, {"SGL_SM120_DEBUG_PROBE_DROP": "1-0"})
    # it stands for a broken P2P path: device memory only, unless asked (the overlay's host-memory retry)
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0"}, memory="host") == -1
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0@host"}, memory="host") == 0
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0@host"}, memory="device") == -1
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0:5@any"}, round_index=5, memory="host") == 0
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0@device"}, memory="device") == 0
    with pytest.raises(ValueError, match="@device"):
        probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0@p2p"})
    assert probe.failed_pairs([[1, 2], [1, 1]], "parity 1, the end of the region") == [
        (1, 0, "write never arrived (parity 1, the end of the region)")
    ]
    err = k.IpcAllReduceProbeError([(1, 0, "write never arrived")])
    assert isinstance(err, k.IpcAllReduceError) and err.pairs == [(1, 0, "write never arrived")]
    assert "rank 1 -> rank 0: write never arrived" in str(err) and "iommu=pt" in str(err)


def test_probe_drop_switch_reaches_the_read_rounds():
    env = {"SGL_SM120_DEBUG_PROBE_DROP": "1:0:read"}
    # `read`: the read rounds only, so the write rounds pass and the reads are what fails
    assert probe.drop_target(1, env, round_index=3, reads=False) == -1
    assert probe.drop_target(1, env, round_index=12, reads=True) == 0
    assert probe.drop_target(0, env, round_index=12, reads=True) == -1
    assert probe.drop_target(1, env) == 0  # the construction's early check: any round
    # no round: every round, reads included; a round number picks that round whatever its kind
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0"}, round_index=12, reads=True) == 0
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0:12"}, round_index=12, reads=True) == 0
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0:12"}, round_index=13, reads=True) == -1
    # device memory only unless asked, as for the writes
    assert probe.drop_target(1, env, round_index=12, memory="host", reads=True) == -1
    assert probe.drop_target(1, {"SGL_SM120_DEBUG_PROBE_DROP": "1:0:read@host"}, round_index=12, memory="host",
                             reads=True) == 0
    for bad in ("1:0:reads", "1:0:read:2", "1:read", "1:0:"):
        with pytest.raises(ValueError, match="SRC:DST:read"):
            probe.drop_target(0, {"SGL_SM120_DEBUG_PROBE_DROP": bad})


def test_probe_names_a_failed_read_by_reader_and_owner():
    # row = the reader: rank 1's loads from rank 0 returned garbage; rank 2's loads from rank 1 saw only the fill
    where = "parity 0, peer loads from the pull area"
    pairs = probe.failed_pairs([[1, 1, 1], [5, 1, 1], [1, 4, 1]], where)
    assert pairs == [
        (0, 1, f"rank 1's loads from rank 0 returned wrong data ({where})"),
        (1, 2, f"rank 2's loads from rank 1 never returned the pattern ({where})"),
    ]
    err = k.IpcAllReduceProbeError(pairs)
    assert f"rank 0 -> rank 1: rank 1's loads from rank 0 returned wrong data ({where})" in str(err), str(err)
    assert "ACS" in str(err) and "iommu=pt" in str(err)
    # an outcome the library may add later is still named, not dropped
    assert probe.failed_pairs([[1, 9], [1, 1]]) == [(1, 0, "outcome 9")]


def test_extension_registers_the_probe_and_close_ops():
    ops = _ext.ops()
    for name in ("ws_probe", "ws_probe_rounds", "ws_probe_round_name", "ws_probe_round_reads", "ws_close_peers",
                 "ws_slow_record_address",
                 "ws_register_shared", "host_shared_bytes_for", "ws_cluster_capacity", "ws_set_launch_limits",
                 "ws_launch_limits", "cluster_capacity_for", "debug_trap", "ws_link_local"):
        assert hasattr(ops, name), name
