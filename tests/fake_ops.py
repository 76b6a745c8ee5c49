"""Stand-ins for the CPU tests of the workspace's construction: the library's ops (FakeOps, failing where a scenario
says) and the ranks of a group as threads of this process (ThreadExchange, counting its rounds)."""

from __future__ import annotations

import ctypes
import json
import threading

import torch

from sgl_kernel_sm120.watchdog import ErrorRecord, SlowRecord

LIMITS_JSON = {"plain_max_threads": 512, "max_packs_per_thread": 16, "max_fused_hidden": 65536, "max_world": 8,
               "max_ctas": 256, "pack_bytes": 16, "elems_per_pack": 8, "owner_block_packs": 32,
               "schedule_oneshot": 0, "schedule_twoshot": 1, "schedule_island": 2, "transport_push": 0,
               "transport_staged": 1, "transport_pull": 2, "memory_device": 0, "memory_host": 1}


class FakeOps:
    """The workspace ops as construction, the probe and close call them. `fails`: the op that raises here;
    `probe_outcome`: what every peer's probe writes did (0: arrived; csrc/ar_types.h ProbeOutcome), the failed place
    at slab offset 4096."""

    def __init__(self, fails: str | None = None, probe_outcome: int = 0, world: int = 2):
        self.fails, self.probe_outcome, self.world = fails, probe_outcome, world
        self.live: set[int] = set()  # handles created and not destroyed
        self.records: dict[int, tuple[ErrorRecord, SlowRecord]] = {}
        self._next = 1

    def _maybe_fail(self, op):
        if op == self.fails:
            raise RuntimeError(f"{op}: stand-in failure")

    def ws_create(self, *args):
        self._maybe_fail("ws_create")
        handle, self._next = self._next, self._next + 1
        self.live.add(handle)
        self.records[handle] = (ErrorRecord(), SlowRecord())
        return handle

    def ws_destroy(self, handle):
        self.live.discard(handle)

    def ws_ipc_handle(self, handle):
        self._maybe_fail("ws_ipc_handle")
        return torch.full((64,), handle, dtype=torch.uint8)

    def ws_open_peers(self, handle, handles):
        self._maybe_fail("ws_open_peers")
        assert tuple(handles.shape) == (self.world, 64)

    def ws_close_peers(self, handle):
        self._maybe_fail("ws_close_peers")

    def host_shared_bytes_for(self, world, max_numel, oneshot_max_numel):
        return 4096

    def ws_register_shared(self, handle):
        self._maybe_fail("ws_register_shared")

    def ws_unlink_shared(self, handle):
        self._maybe_fail("ws_unlink_shared")

    def ws_cluster_capacity(self, handle):
        return [0, 0, 0]

    def ws_sm_count(self, handle):
        return 132

    def ws_set_launch_limits(self, handle, sm_budget, capacity):
        self._maybe_fail("ws_set_launch_limits")

    def ws_probe(self, handle, timeout_s, drop_peer, drop_mode):
        at = 4096 if self.probe_outcome else -1
        return [self.probe_outcome, at, 0, -1] * self.world

    def ws_probe_place_name(self, handle, slab_offset):
        return f"the page at slab byte {slab_offset}"

    def ws_error_record_address(self, handle):
        return ctypes.addressof(self.records[handle][0])

    def ws_slow_record_address(self, handle):
        return ctypes.addressof(self.records[handle][1])

    def ws_calls_completed(self, handle):
        return 0

    def ws_check_context(self, handle):
        self._maybe_fail("ws_check_context")

    def kernel_limits(self):
        return json.dumps(LIMITS_JSON)


class ThreadExchange:
    """Rank `rank` of a group whose ranks are threads of this process; payloads cross as JSON, as over a store."""

    def __init__(self, shared: dict, rank: int):
        self.shared, self.rank, self.world_size = shared, rank, len(shared["slots"])
        self.rounds = self.barriers = 0

    @staticmethod
    def group(world: int) -> list[ThreadExchange]:
        shared = {"slots": [None] * world, "barrier": threading.Barrier(world, timeout=20)}
        return [ThreadExchange(shared, rank) for rank in range(world)]

    def all_gather(self, obj):
        self.shared["slots"][self.rank] = json.loads(json.dumps(obj))
        self.shared["barrier"].wait()
        gathered = list(self.shared["slots"])
        self.shared["barrier"].wait()
        self.rounds += 1
        return gathered

    def barrier(self, timeout_s: float) -> None:
        self.shared["barrier"].wait()
        self.barriers += 1


def run_threads(world: int, fn) -> list:
    """fn(rank, exchange) on `world` threads named rank0.., each answer (or the exception it raised) by rank."""
    exchanges = ThreadExchange.group(world)
    answers: list = [None] * world

    def body(rank):
        try:
            answers[rank] = fn(rank, exchanges[rank])
        except Exception as exc:  # handed to the test
            answers[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return answers
