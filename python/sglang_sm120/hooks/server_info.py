"""Replacement for the scheduler's internal-state report, so the backend's state and call counters can be read
from outside the server: `GET /get_server_info` (and `/server_info` in 0.5.23) returns each scheduler's internal
state under "internal_states"; ours is the entry "sm120_allreduce" there.

The counters that matter are the device-side ones (`device_calls`): decode and verify run as CUDA-graph replays,
which run no Python, so the Python-side `stats` see each captured call once. The device counter is read without
synchronizing the GPU (sgl_kernel_sm120.IpcAllReduce.calls_completed), so a request for the server info never
waits for a forward.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .distributed import tp_communicator

logger = logging.getLogger("sglang_sm120")

STATE_KEY = "sm120_allreduce"


def sm120_state() -> dict[str, Any]:
    comm = tp_communicator()
    if comm is None:
        return {"enabled": False, "active": False,
                "reason": "no sm120 backend on this process's TP group (mode off, TP size 1, or not a CUDA group)"}
    return comm.describe()


def wrap_get_internal_state(original):
    @functools.wraps(original)
    def get_internal_state(self, recv_req):
        result = original(self, recv_req)
        state = getattr(result, "internal_state", None)
        if isinstance(state, dict):
            try:
                state[STATE_KEY] = sm120_state()
            except Exception as exc:  # a monitoring read must never break the server-info request
                logger.warning("sglang_sm120: reporting the backend state failed: %s", exc)
                state[STATE_KEY] = {"error": f"{type(exc).__name__}: {exc}"}
        return result

    return get_internal_state
