"""One candidate at one size on this process's ranks as lanes (one in a rank's process, all W in a one-process
group), checked and timed in one pass. The graph holds `calls` calls per lane, call k on slot k, so several calls
are in flight on distinct buffers as in a server's graph:
1. `burst` replays with no host synchronization, each after new inputs and NaN outputs, each timed and checked on
   the device: a candidate that returns the previous call's result, reads the previous call's input or reuses a
   buffer its peer (or its own previous call) still reads fails here; the burst's times rank the candidates;
2. for a candidate being profiled, `warmup` and `replays` more replays back to back, timed (the checked graph is the
   timed one), then their outputs checked.
Every check stays on the device until the one synchronization at the end; the fingerprints of every output checked
make this process's digest, which the Tuner compares across ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sgl_kernel_sm120.policy import Route, resolve

from . import verify
from .verify import SizeBank


class CudaBackend:
    """The device work of a Trial on one CUDA device, one stream per lane (the CPU tests fake it)."""

    def __init__(self, device, lanes: int):
        self.device = torch.device(device)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(lanes)]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture(self, lanes: Sequence[Sequence[Callable[[], Any]]]):
        """One graph, one branch per lane (each on its stream, forked from and joined into the capture stream):
        a graph's kernels load at instantiation, so the lanes' first launches cannot wait on one another."""
        main = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=main, capture_error_mode="thread_local"):
            for stream in self.streams:
                stream.wait_stream(main)
            for stream, calls in zip(self.streams, lanes, strict=True):
                with torch.cuda.stream(stream):
                    for call in calls:
                        call()
            for stream in self.streams:
                main.wait_stream(stream)
        return graph

    def timer(self):
        """A pair of events around work on the current stream: (start(), stop(), read() -> us once synchronized)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return start.record, end.record, lambda: start.elapsed_time(end) * 1000.0


class Slots:
    """One size's call buffers, shared by its candidates (each feeds them before it replays): per lane the inputs
    [calls, rows, hidden] and outputs [calls, outputs, rows, hidden], and the fused residual."""

    def __init__(self, bank: SizeBank, calls: int):
        self.bank, self.calls = bank, int(calls)
        like = bank.expected[0, 0]
        self.x = {lane: torch.empty((self.calls, *like.shape), dtype=like.dtype, device=like.device)
                  for lane in bank.lanes}
        self.out = {lane: torch.empty((self.calls, bank.outputs, *like.shape), dtype=like.dtype, device=like.device)
                    for lane in bank.lanes}
        self.residual = torch.empty_like(self.x[bank.lanes[0]]) if bank.kind == "fused" else None
        # case index of slot k at offset o: ring[o + k] (a view, nothing copied from the host per replay)
        self.ring = torch.arange(2 * bank.cases, device=like.device) % bank.cases

    def cases(self, offset: int):
        start = offset % self.bank.cases
        return self.ring[start:start + self.calls]

    def feed(self, offset: int) -> None:
        index = self.cases(offset)
        for lane in self.bank.lanes:
            torch.index_select(self.bank.x[lane], 0, index, out=self.x[lane])
            self.out[lane].fill_(float("nan"))
        if self.residual is not None:
            torch.index_select(self.bank.residual, 0, index, out=self.residual)


class Trial:
    """Graph and checks of `route` at one size, lane r's calls on workspaces[r]. A kernel wait that timed out
    returns at once, and would otherwise look fast or hide a race: its workspace's record raises after the
    synchronization (also when the synchronization itself failed, a trap having ended the context)."""

    def __init__(self, slots: Slots, route: Route, route_id: str, workspaces: Mapping[int, Any], backend):
        self.slots, self.bank, self.backend, self.workspaces = slots, slots.bank, backend, dict(workspaces)
        self.offset = verify.salt(route_id)
        lanes = [[self._call(workspaces[lane], route, lane, k) for k in range(slots.calls)] for lane in self.bank.lanes]
        self.graph = backend.capture(lanes)
        device = slots.ring.device
        self.wrong = torch.zeros((), dtype=torch.int64, device=device)

    def _raise_recorded_timeout(self) -> None:
        for lane, ws in self.workspaces.items():
            if (err := ws.timeout_error()) is not None:
                raise RuntimeError(f"rank {lane}: {err}") from None

    def _call(self, ws, route: Route, lane: int, k: int) -> Callable[[], Any]:
        """One call, its arguments checked once, here; it launches the route resolved as a server resolves it."""
        slots, bank, fused = self.slots, self.bank, self.bank.kind == "fused"
        x, outs = slots.x[lane][k], tuple(slots.out[lane][k])
        residual = slots.residual[k] if fused else None
        why = ws.refusal(x, route, fused=fused, residual=residual, weight=bank.weight, outs=outs)
        if why:
            raise ValueError(f"{route.id} cannot run here: {why}")
        resolved = resolve(route, x.numel() * x.element_size(), ws.shape, ws.limits, fused)
        if not fused:
            return lambda: ws.launch(resolved, x, outs[0])
        return lambda: ws.launch_fused_into(resolved, x, residual, bank.weight, bank.eps, outs[0], outs[1])

    def _check(self, where: str, offset: int) -> None:
        """Stream-ordered: every lane's outputs against the cases fed at `offset`, counted and fingerprinted."""
        expected = self.bank.expected.index_select(0, self.slots.cases(offset))
        for lane in self.bank.lanes:
            per_slot = verify.wrong_elements(self.slots.out[lane], expected)
            self.wrong_at.append((f"{where}, rank {lane}", per_slot))
            self.wrong += per_slot.sum()
            self.prints[lane].append(verify.fingerprint(self.slots.out[lane]))

    def run(self, burst: int, warmup: int = 0, replays: int = 0) -> tuple[str, list[float]]:
        """(this process's digest, us per call of each timed replay): the burst's replays when `replays` is 0,
        else the profile's. Raises AssertionError naming the first wrong output."""
        timers, offset = [], self.offset
        self.wrong.zero_()  # a kept Trial runs again for its profile: only this run's checks count
        self.wrong_at: list[tuple[str, Any]] = []  # (where, per-slot counts), read after the one synchronization
        self.prints = {lane: [] for lane in self.bank.lanes}
        for b in range(max(1, int(burst))):
            offset = self.offset + b * self.slots.calls
            self.slots.feed(offset)
            timers.append(self._timed_replay())
            self._check(f"graph replay {b + 1}", offset)
        if replays:
            for _ in range(int(warmup)):
                self.graph.replay()
            timers = [self._timed_replay() for _ in range(int(replays))]
            self._check(f"after {warmup + replays} more replays", offset)
        try:
            self.backend.synchronize()
        except Exception:
            self._raise_recorded_timeout()
            raise
        self._raise_recorded_timeout()
        lanes = self.bank.lanes
        values = torch.stack([self.wrong, *(p for lane in lanes for p in self.prints[lane])]).tolist()  # one copy
        if values[0]:
            self._raise_first_wrong()
        per_lane = len(self.prints[lanes[0]])
        prints = [values[1 + i * per_lane:1 + (i + 1) * per_lane] for i in range(len(lanes))]
        if any(p != prints[0] for p in prints):  # lanes of this process; across ranks: the Tuner
            raise AssertionError("the ranks' outputs differ in some bit")
        return hashlib.sha256(repr(prints[0]).encode()).hexdigest(), [read() / self.slots.calls for read in timers]

    def _timed_replay(self) -> Callable[[], float]:
        start, stop, read = self.backend.timer()
        start()
        self.graph.replay()
        stop()
        return read

    def _raise_first_wrong(self) -> None:
        size = self.bank.outputs * self.bank.rows * self.bank.hidden
        for where, per_slot in self.wrong_at:
            for k, count in enumerate(per_slot.tolist()):
                if count:
                    raise AssertionError(f"{where} call {k + 1}: {count} of {size} output elements wrong")
        raise AssertionError("wrong outputs")
