"""The backend's state and call counters in SGLang's server info: `GET /get_server_info` (0.5.23 also
`/server_info`) holds each scheduler's internal state under "internal_states"; ours is its "sm120_allreduce".

Decode and verify run as CUDA-graph replays, which run no Python, so the counter that matters is `device_calls`,
counted on the GPU and read without synchronizing it (a server-info request never waits for a forward).
"""

from __future__ import annotations

import functools
import logging

from .distributed import tp_backend

logger = logging.getLogger("sglang_sm120")

STATE_KEY = "sm120_allreduce"


def sm120_state() -> dict:
    backend = tp_backend()
    if backend is None:
        return {"enabled": False, "active": False,
                "reason": "no sm120 backend on this process's TP group (mode off, TP size 1, or not a CUDA group)"}
    return backend.describe()


def wrap_get_internal_state(original):
    @functools.wraps(original)
    def get_internal_state(self, recv_req):
        result = original(self, recv_req)
        state = getattr(result, "internal_state", None)
        if isinstance(state, dict):
            try:
                state[STATE_KEY] = sm120_state()
            except Exception as exc:  # a monitoring read must never break the request
                logger.warning("sglang_sm120: reporting the backend state failed: %s", exc)
                state[STATE_KEY] = {"error": f"{type(exc).__name__}: {exc}"}
        return result

    return get_internal_state
