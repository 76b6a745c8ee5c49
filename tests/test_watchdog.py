"""The watchdog (sgl_kernel_sm120/watchdog.py) on CPU: the records live in ordinary memory here, as the kernels
would write them into host-mapped memory."""

from __future__ import annotations

import ctypes
import logging
import time

import pytest

import sgl_kernel_sm120 as k
from sgl_kernel_sm120 import watchdog as mod


def _dog(rank=0):
    error, slow = mod.ErrorRecord(), mod.SlowRecord()
    return error, slow, mod.Watchdog(rank, error, slow, timeout_s=300.0, on_timeout="exit", abort_after_s=0.0,
                                     context_alive=lambda: True)


def test_the_records_have_the_layout_of_the_c_structs():
    assert ctypes.sizeof(mod.ErrorRecord) == 32 and ctypes.sizeof(mod.SlowRecord) == 32  # csrc/ar_types.h


def test_a_slow_wait_is_read_whole_and_logged_once_per_call(caplog):
    _, slow, dog = _dog()
    assert dog.slow_wait() is None and dog.timeout_error() is None
    caplog.set_level(logging.WARNING, logger="sgl_kernel_sm120")
    dog.start()
    try:
        slow.rank, slow.peer, slow.phase, slow.waited_ns = 0, 1, 1, 5_500_000_000
        slow.call_plus_one = 8  # call #7, written last as the kernel does
        assert dog.slow_wait() == (7, 1, "one-shot", 5.5)
        time.sleep(4 * mod.POLL_S)
        slow.call_plus_one = 9
        time.sleep(4 * mod.POLL_S)
    finally:
        dog.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "call #7 has waited 5.5 s in the one-shot phase for rank 1" in messages[0], messages
    assert "call #8" in messages[1] and "only after 300 s, SGL_SM120_AR_TIMEOUT_S" in messages[1], messages


def test_a_recorded_timeout_is_read_and_logged_and_the_records_are_let_go_before_they_are_freed(caplog):
    error, _, dog = _dog(rank=2)
    caplog.set_level(logging.ERROR, logger="sgl_kernel_sm120")
    dog.start()
    try:
        error.rank, error.peer, error.phase, error.seq, error.waited_ns = 2, 5, 4, 11, 300_000_000_000
        error.flag = 1
        found = dog.timeout_error()
        assert isinstance(found, k.IpcAllReduceTimeoutError) and not found.context_lost
        assert (found.rank, found.peer, found.phase, found.seq) == (2, 5, "all-gather", 11)
        time.sleep(4 * mod.POLL_S)
    finally:
        dog.forget_records()
    assert dog.timeout_error() is None and dog.slow_wait() is None
    assert any("call #11 waited 300.00 s in the all-gather phase for rank 5" in r.getMessage()
               for r in caplog.records), caplog.records


class _Aborted(Exception):
    pass


def test_a_trap_that_never_arrives_aborts_the_process_after_the_bound(monkeypatch):
    def abort():
        raise _Aborted  # os.abort never returns

    monkeypatch.setattr(mod.os, "abort", abort)
    error, slow = mod.ErrorRecord(), mod.SlowRecord()
    error.flag = 1
    alive = mod.Watchdog(0, error, slow, timeout_s=1.0, on_timeout="trap", abort_after_s=0.2,
                         context_alive=lambda: True)
    with pytest.raises(_Aborted):
        alive._abort_if_trap_never_arrives(alive.timeout_error())

    def gone():
        raise RuntimeError("the trap ended the context")

    dead = mod.Watchdog(0, error, slow, timeout_s=1.0, on_timeout="trap", abort_after_s=0.2, context_alive=gone)
    dead._abort_if_trap_never_arrives(dead.timeout_error())  # the trap reached this process: it returns
