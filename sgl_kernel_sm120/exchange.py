"""How the ranks of one workspace agree: every collective step of its construction and of its close goes through
one exchange, an object with `rank`, `world_size`, `all_gather(obj) -> list` (every rank's obj, in rank order) and
`barrier(timeout_s)`. `IpcAllReduce` takes such an object, or a torch.distributed CPU (gloo) group, which it wraps in
`GlooExchange`. Payloads are JSON values (bytes travel as hex), so an exchange over a key-value store carries them as
well as gloo does; `GlooExchange` sends them as JSON too, so both hand back the same values (lists, never tuples).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

from .errors import IpcAllReduceError, IpcAllReduceHostMemoryError


class GlooExchange:
    """An exchange over a torch.distributed CPU group (gloo), within the group's own timeout."""

    def __init__(self, group):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, obj: Any) -> list:
        gathered: list = [None] * self.world_size
        self._dist.all_gather_object(gathered, json.dumps(obj), group=self.group)
        return [json.loads(text) for text in gathered]

    def barrier(self, timeout_s: float) -> None:
        self._dist.monitored_barrier(self.group, timeout=datetime.timedelta(seconds=timeout_s))


def exchange_of(group_or_exchange):
    """An exchange as it is; a process group wrapped in GlooExchange (a ProcessGroup's rank is a method, not an int)."""
    if isinstance(getattr(group_or_exchange, "rank", None), int):
        return group_or_exchange
    return GlooExchange(group_or_exchange)


def attempt(step: Callable[[], Any]) -> tuple[dict | None, Any]:
    """(None, what `step` returned), or (its error, None): a rank's outcome of a collective step. The error is its
    kind (IpcAllReduceError.kind), its text, and a host-memory shortfall's sentence: codes, not words, cross ranks."""
    try:
        return None, step()
    except Exception as exc:  # every rank must learn of it: see agree()
        kind = exc.kind if isinstance(exc, IpcAllReduceError) else IpcAllReduceError.kind
        tmpfs = exc.tmpfs if isinstance(exc, IpcAllReduceHostMemoryError) else None
        return {"kind": kind, "text": f"{type(exc).__name__}: {exc}", "tmpfs": tmpfs}, None


def agree(exchange, step: str, error: dict | None, payload: Any = None) -> list:
    """One round: every rank's (error, payload) gathered. If any rank failed, every rank raises the same error
    naming each failed rank, so no rank waits in a later round for a peer that gave up (IpcAllReduceHostMemoryError
    when a rank's tmpfs was short, with its sentence); else every rank's payload, in rank order."""
    outcomes = exchange.all_gather([error, payload])
    failed = {rank: err for rank, (err, _) in enumerate(outcomes) if err}
    if not failed:
        return [payload for _, payload in outcomes]
    detail = "; ".join(f"rank {rank}: {err['text']}" for rank, err in sorted(failed.items()))
    message = f"IpcAllReduce {step} failed ({detail})"
    short = [err["tmpfs"] for err in failed.values() if err["kind"] == IpcAllReduceHostMemoryError.kind]
    if short:  # the overlay names the folder and the sizes
        raise IpcAllReduceHostMemoryError(message, short[0])
    raise IpcAllReduceError(message)
