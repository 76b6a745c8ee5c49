"""Time-bounded exchanges between a group's ranks over the c10d key-value store: the one agreement mechanism of a
server's start-up, the backend's rounds and the workspace construction's steps alike.

Not gloo collectives: SGLang logs and swallows a plugin's exception, so one rank can come up without the overlay
while its peers wait for it, and a gloo all-gather would block them for the group's timeout (hours). A store `wait`
with a timeout returns, and every rank falls back to NCCL together.

`agree` runs two rounds, payloads then verdicts ("I got every payload" or why not), and returns only if every
verdict says yes. The verdict round waits `VERDICT_GRACE_S` longer: a live rank publishes its verdict at most one
payload timeout after its payload, so live ranks always see each other's verdicts and agree; only a rank that dies
in between can leave its peers disagreeing, and the kernels' bounded waits turn that into an error.
"""

from __future__ import annotations

import itertools
import json
import threading
from datetime import timedelta
from typing import Any

VERDICT_GRACE_S = 30.0

_lock = threading.Lock()
_sequences: dict[tuple[str, int], itertools.count] = {}


class ExchangeTimeout(RuntimeError):
    pass


class AgreementFailed(RuntimeError):
    pass


def next_prefix(scope: str, rank: int) -> str:
    """The key prefix of `rank`'s n-th exchange in `scope`: ranks make the same exchanges in the same order, so the
    n-th gets the same prefix everywhere without communicating (counted per rank: threads as ranks work)."""
    with _lock:
        return f"sglang_sm120/{scope}/{next(_sequences.setdefault((scope, rank), itertools.count()))}"


def exchange(store, prefix: str, rank: int, world_size: int, payload: Any, timeout_s: float) -> list[Any]:
    """Publish `payload` (JSON) as prefix/rank and return every rank's, in rank order; ExchangeTimeout names the
    ranks that did not publish within `timeout_s`."""
    store.set(f"{prefix}/{rank}", json.dumps(payload))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:
        missing = [r for r, key in enumerate(keys) if not _present(store, key)]
        if missing:  # else raced with the last writer: every key is there after all
            raise ExchangeTimeout(f"{prefix}: no answer from ranks {missing} within {timeout_s:.0f}s") from exc
    return [json.loads(v.decode() if isinstance(v, bytes | bytearray) else str(v)) for v in map(store.get, keys)]


def agree(store, prefix: str, rank: int, world_size: int, payload: Any, timeout_s: float) -> list[Any]:
    """Exchange payloads; every live rank either returns the same list or raises AgreementFailed."""
    payloads, problem = None, None
    try:
        payloads = exchange(store, f"{prefix}/payload", rank, world_size, payload, timeout_s)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    try:
        verdicts = exchange(store, f"{prefix}/verdict", rank, world_size, {"ok": problem is None, "why": problem},
                            timeout_s + VERDICT_GRACE_S)
    except Exception as exc:
        raise AgreementFailed(f"agreement on {prefix} failed: {exc}") from exc
    bad = "; ".join(f"rank {r}: {v.get('why')}" for r, v in enumerate(verdicts) if not v.get("ok"))
    if bad:
        raise AgreementFailed(f"agreement on {prefix} failed ({bad})")
    return payloads


class StoreExchange:
    """The collective steps of a workspace's construction (sgl_kernel_sm120.IpcAllReduce takes any object with these
    members) over the store, each bounded by `timeout_s`."""

    def __init__(self, store, scope: str, rank: int, world_size: int, timeout_s: float):
        self.store, self.scope, self.rank, self.world_size, self.timeout_s = store, scope, rank, world_size, timeout_s

    def all_gather(self, obj: Any, timeout_s: float | None = None) -> list[Any]:
        return exchange(self.store, next_prefix(self.scope, self.rank), self.rank, self.world_size, obj,
                        self.timeout_s if timeout_s is None else timeout_s)

    def barrier(self, timeout_s: float | None = None) -> None:
        self.all_gather(None, timeout_s)


def _present(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False
