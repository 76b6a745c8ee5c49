"""One candidate at one size on this process's ranks as lanes (one in a rank's process, all W in a one-process
group). The graph holds `calls` calls per lane, call k on slot k, so several calls are in flight on distinct buffers
as in a server's graph; every call is fed inputs of its own (tuning/verify.py):
1. `verify_calls` eager calls, each checked with the device synchronized in between;
2. `burst_replays` replays back to back with no host synchronization, each after new inputs and NaN outputs, then
   all checked: a candidate that returns the previous call's result, reads the previous call's input or reuses a
   buffer its peer (or its own previous call) still reads fails here;
3. the timed replays of the same graph (the checked graph is the timed one), then a check of their outputs.
The fingerprints of every output checked make this process's digest, which the Tuner compares across ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from sgl_kernel_sm120.policy import Route, resolve

from ..routing.table import route_id
from . import timing, verify
from .verify import CallBank, salt


class CudaBackend:
    """The device work of a CandidateRun on one CUDA device, one stream per lane (the CPU tests fake it)."""

    def __init__(self, device, lanes: int):
        self.device = torch.device(device)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(lanes)]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def lane(self, index: int):
        return torch.cuda.stream(self.streams[index])

    def capture(self, lanes: Sequence[Sequence[Callable[[], Any]]]):
        """One graph, one branch per lane (each on its stream, forked from and joined into the capture stream):
        a graph's kernels load at instantiation, so the lanes' first launches cannot wait on one another."""
        main = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=main, capture_error_mode="thread_local"):
            for stream in self.streams:
                stream.wait_stream(main)
            for index, calls in enumerate(lanes):
                with self.lane(index):
                    for call in calls:
                        call()
            for stream in self.streams:
                main.wait_stream(stream)
        self.synchronize()
        return graph

    def replay_times(self, graph, iters: int, warmup: int) -> list[float]:
        return timing.replay_times(graph, iters, warmup=warmup)


class CandidateRun:
    """Slots, graph and checks of `route` at one size, rank r's calls on workspaces[r]. `check_timeouts()` raises
    when a kernel wait of this process timed out (it returns at once, and would otherwise look fast or hide a race)."""

    def __init__(self, bank: CallBank, route: Route, workspaces: Mapping[int, Any], calls: int, backend,
                 check_timeouts: Callable[[], None]):
        self.bank, self.ranks, self.calls = bank, list(workspaces), max(1, int(calls))
        self.backend, self.check_timeouts = backend, check_timeouts
        self.next_salt = salt(route_id(route))
        like = next(iter(bank.base.values()))
        self.x = {r: [torch.empty_like(like) for _ in range(self.calls)] for r in self.ranks}
        self.residual = [torch.empty_like(like) for _ in range(self.calls)] if bank.kind == "fused" else None
        self.outs = {r: [tuple(torch.empty_like(like) for _ in bank.output_names) for _ in range(self.calls)]
                     for r in self.ranks}
        self.call = {r: [self._checked_call(workspaces[r], route, self.x[r][k],
                                            self.residual[k] if self.residual else None, self.outs[r][k])
                         for k in range(self.calls)] for r in self.ranks}
        self.graph = None
        self.fed: list[int] = [0] * self.calls  # the salt whose inputs each slot holds
        self.prints: list[str] = []

    def _checked_call(self, ws, route: Route, x, residual, outs: tuple) -> Callable[[], Any]:
        """One call, its arguments checked once, here; it launches the route resolved as a server resolves it."""
        bank, fused = self.bank, self.bank.kind == "fused"
        why = ws.refusal(x, route, fused=fused, residual=residual, weight=bank.weight, outs=outs)
        if why:
            raise ValueError(f"{route.id} cannot run here: {why}")
        resolved = resolve(route, x.numel() * x.element_size(), ws.shape, ws.limits, fused)
        if not fused:
            return lambda: ws.launch(resolved, x, outs[0])
        return lambda: ws.launch_fused(resolved, x, residual, bank.weight, bank.eps, outs[0], outs[1])

    def _feed(self, k: int) -> None:
        value, self.next_salt = self.next_salt, self.next_salt + 1
        given = self.bank.inputs(value)
        for r in self.ranks:
            self.x[r][k].copy_(given["x"][r])
            for out in self.outs[r][k]:
                out.fill_(float("nan"))
        if self.residual is not None:
            self.residual[k].copy_(given["residual"])
        self.fed[k] = value

    def _outputs(self, k: int, copy: bool = False) -> dict[int, tuple]:
        return {r: tuple(o.clone() if copy else o for o in self.outs[r][k]) for r in self.ranks}

    def _check(self, where: str, value: int, outputs: dict[int, tuple]) -> None:
        expected = self.bank.expected(value)
        for r in self.ranks:
            for name, got, want in zip(self.bank.output_names, outputs[r], expected, strict=True):
                if not verify.same_values(got, want):
                    raise AssertionError(verify.mismatch(f"{where} rank {r} {name}", got, want) or
                                         f"{where} rank {r} {name}: differs")
        mine = [verify.fingerprint(outputs[r]) for r in self.ranks]
        if any(m != mine[0] for m in mine):  # this process's lanes; the Tuner compares the processes' digests
            raise AssertionError(f"{where}: the ranks' outputs differ in some bit")
        self.prints += mine

    def _settle(self) -> None:
        self.backend.synchronize()
        self.check_timeouts()

    def verify(self, eager_calls: int, replays: int) -> str:
        """The digest of every output checked, in order: equal across ranks when their bits are."""
        for j in range(max(1, int(eager_calls))):
            k = j % self.calls
            self._feed(k)
            self.backend.synchronize()
            for index, r in enumerate(self.ranks):  # call-major: one-process groups need it (local_group)
                with self.backend.lane(index):
                    self.call[r][k]()
            self._settle()
            self._check(f"eager call {j + 1}", self.fed[k], self._outputs(k))
        self.graph = self.backend.capture([self.call[r] for r in self.ranks])
        records = []
        for b in range(max(1, int(replays))):
            for k in range(self.calls):
                self._feed(k)
            self.graph.replay()
            records += [(f"graph replay {b + 1} call {k + 1}", self.fed[k], self._outputs(k, copy=True))
                        for k in range(self.calls)]
        self._settle()
        for where, value, outputs in records:
            self._check(where, value, outputs)
        return hashlib.sha256(",".join(self.prints).encode()).hexdigest()

    def time(self, iters: int, warmup: int) -> list[float]:
        per_replay = self.backend.replay_times(self.graph, int(iters), int(warmup))
        self._settle()
        for k in range(self.calls):
            self._check(f"after the timed replays, call {k + 1}", self.fed[k], self._outputs(k))
        return [t / self.calls for t in per_replay]
