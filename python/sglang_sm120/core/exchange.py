"""Time-bounded exchanges between the ranks of a group, over the c10d key-value store.

Why not gloo collectives: SGLang logs and swallows a plugin's exception, so one rank can come up without the
overlay while its peers wait for it. A gloo all-gather would then block for the group's timeout (two hours
in SGLang). A store `wait` with a timeout returns, and every rank falls back to NCCL together.

Agreement (`agree`) runs two rounds. Round 1 exchanges payloads; each rank then publishes a verdict (round 2:
"I got every payload" or why not) and proceeds only if every verdict says yes. Round 2 waits longer than
round 1 (`VERDICT_GRACE_S`): a live rank publishes its verdict at most one round-1 timeout after it
published its payload, and every rank that finished round 1 started waiting after all payloads were
published, so live ranks always see each other's verdicts and agree. Only a rank that dies or hangs in
between can leave its peers disagreeing, and then the kernel's own bounded waits turn it into an error.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any

logger = logging.getLogger(__name__)

KEY_ROOT = "sglang_sm120"
VERDICT_GRACE_S = 30.0

_sequence_lock = threading.Lock()
_sequences: dict[tuple[str, int], itertools.count] = {}


class ExchangeTimeout(RuntimeError):
    def __init__(self, what: str, missing: list[int], timeout_s: float):
        self.missing = missing
        super().__init__(f"{what}: no answer from ranks {missing} within {timeout_s:.0f}s")


class AgreementFailed(RuntimeError):
    pass


def next_prefix(scope: str, rank: int) -> str:
    """A key prefix for `rank`'s n-th exchange in `scope`. Ranks make the same exchanges in the same order,
    so the n-th exchange gets the same prefix on every rank without communicating. (Counted per rank, not
    per process, so ranks simulated as threads of one process stay in step too.)"""
    with _sequence_lock:
        counter = _sequences.setdefault((scope, rank), itertools.count())
        return f"{KEY_ROOT}/{scope}/{next(counter)}"


def exchange(store, prefix: str, rank: int, world_size: int, payload: Any, timeout_s: float) -> list[Any]:
    """Publish `payload` (JSON-serialisable) under prefix/rank, return every rank's payload in rank order.

    Raises ExchangeTimeout naming the ranks that did not publish within `timeout_s`."""
    store.set(f"{prefix}/{rank}", json.dumps(payload))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:
        missing = _missing(store, keys)
        if not missing:  # raced with the last writer: every key is there after all
            logger.debug("store wait raised %s but every key is present", exc)
        else:
            raise ExchangeTimeout(prefix, missing, timeout_s) from exc
    return [json.loads(_as_text(store.get(key))) for key in keys]


def agree(store, prefix: str, rank: int, world_size: int, payload: Any, timeout_s: float) -> list[Any]:
    """Exchange payloads; every live rank either returns the same list or raises AgreementFailed."""
    payloads: list[Any] | None = None
    local_problem: str | None = None
    start = time.monotonic()
    try:
        payloads = exchange(store, f"{prefix}/payload", rank, world_size, payload, timeout_s)
    except Exception as exc:
        local_problem = f"{type(exc).__name__}: {exc}"
    verdict = {"ok": local_problem is None, "why": local_problem}
    try:
        verdicts = exchange(store, f"{prefix}/verdict", rank, world_size, verdict, timeout_s + VERDICT_GRACE_S)
    except Exception as exc:
        raise AgreementFailed(f"agreement on {prefix} failed: {exc}") from exc
    bad = {r: v.get("why") for r, v in enumerate(verdicts) if not v.get("ok")}
    if bad:
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(bad.items()))
        raise AgreementFailed(f"agreement on {prefix} failed ({detail})")
    logger.debug("agreement on %s took %.3fs", prefix, time.monotonic() - start)
    assert payloads is not None
    return payloads


def _missing(store, keys: list[str]) -> list[int]:
    missing = []
    for index, key in enumerate(keys):
        try:
            present = store.check([key])
        except Exception:
            present = False
        if not present:
            missing.append(index)
    return missing


def _as_text(value) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)
