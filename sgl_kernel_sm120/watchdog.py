"""A workspace's wait records and the thread that watches them (docs/design.md, "Waits are bounded"): a slow wait
(I9: a peer still compiling can be that late) is logged once per call, a timeout (I7) as soon as it is recorded,
read with plain CPU loads that work after a trap, so the log names the missing peer even when the CUDA error
surfaces elsewhere first; in trap mode a process whose trap never arrived is aborted (seen with several processes
on one GPU), as PyTorch's NCCL watchdog does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable

from .errors import IpcAllReduceTimeoutError
from .settings import VARIABLES

logger = logging.getLogger(__name__)

ON_TIMEOUT_MODES = ("trap", "exit")  # I7: "trap" ends the CUDA context, "exit" poisons the workspace
PHASES = {1: "one-shot", 2: "reduce-scatter", 3: "cross-island", 4: "all-gather"}  # csrc/ar_types.h enum Phase
POLL_S = 0.1


class ErrorRecord(ctypes.Structure):  # struct ErrorRecord in csrc/ar_types.h
    _fields_ = [("flag", ctypes.c_int), ("rank", ctypes.c_int), ("peer", ctypes.c_int), ("phase", ctypes.c_int),
                ("seq", ctypes.c_longlong), ("waited_ns", ctypes.c_longlong)]


class SlowRecord(ctypes.Structure):  # struct SlowRecord in csrc/ar_types.h
    _fields_ = [("call_plus_one", ctypes.c_longlong), ("rank", ctypes.c_int), ("peer", ctypes.c_int),
                ("phase", ctypes.c_int), ("pad", ctypes.c_int), ("waited_ns", ctypes.c_longlong)]


class Watchdog:
    """The records of one workspace and the thread that watches them. `context_alive()` answers whether the CUDA
    context still runs calls (it raises once a trap has ended it)."""

    def __init__(self, rank: int, error: ErrorRecord, slow: SlowRecord, *, timeout_s: float, on_timeout: str,
                 abort_after_s: float, context_alive: Callable[[], bool]):
        self.rank, self.timeout_s, self.on_timeout, self.abort_after_s = rank, timeout_s, on_timeout, abort_after_s
        self._error, self._slow, self._context_alive = error, slow, context_alive  # records: None once freed
        self._last_slow_call = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sgl-sm120-ar-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (idempotent; from the thread itself too)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def forget_records(self) -> None:
        """Before the pinned block that holds both records is freed."""
        self.stop()
        self._error = self._slow = None

    def timeout_error(self) -> IpcAllReduceTimeoutError | None:
        rec = self._error
        if rec is None or not rec.flag:
            return None
        return IpcAllReduceTimeoutError(rec.rank, rec.peer, PHASES.get(rec.phase, str(rec.phase)), rec.seq,
                                        rec.waited_ns / 1e9, context_lost=self.on_timeout == "trap")

    def slow_wait(self) -> tuple[int, int, str, float] | None:
        """The latest slow wait reported (I9) as (call, peer, phase, seconds waited), or None. Re-read until the same
        before and after (the kernel writes `call_plus_one` last)."""
        rec = self._slow
        for _ in range(3):
            first = rec.call_plus_one if rec is not None else 0
            if first == 0:
                return None
            found = (first - 1, rec.peer, PHASES.get(rec.phase, str(rec.phase)), rec.waited_ns / 1e9)
            if rec.call_plus_one == first:
                return found
        return None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if (err := self.timeout_error()) is not None:
                logger.error("%s", err)
                if self.on_timeout == "trap" and self.abort_after_s > 0:
                    self._abort_if_trap_never_arrives(err)
                return
            slow = self.slow_wait()
            if slow is not None and slow[0] + 1 != self._last_slow_call:
                call, peer, phase, waited = slow
                self._last_slow_call = call + 1
                logger.warning(
                    "sgl_kernel_sm120 all-reduce on rank %d: call #%d has waited %.1f s in the %s phase for rank %d "
                    "(a peer still compiling or loading can be this late; the call fails with "
                    "IpcAllReduceTimeoutError only after %.0f s, %s)",
                    self.rank, call, waited, phase, peer, self.timeout_s, VARIABLES["timeout_s"])

    def _abort_if_trap_never_arrives(self, err: IpcAllReduceTimeoutError) -> None:
        """The kernel trapped right after writing the record, so the context should fail at once. If it still
        answers abort_after_s later, the trap missed this process and whatever waits on the GPU would wait
        forever: end the process rather than hang."""
        deadline = time.monotonic() + self.abort_after_s
        while not self._stop.wait(0.5):
            try:
                if not self._context_alive():
                    return
            except Exception:  # the trap has ended the context
                return
            if time.monotonic() > deadline:
                logger.critical("%s The kernel trapped %.0f s ago but the CUDA error has not reached this process "
                                "(seen when several processes share one GPU); aborting it so that nothing waits on it "
                                "forever (%s=0 keeps it alive).", err, self.abort_after_s,
                                VARIABLES["abort_after_s"])
                for handler in logging.getLogger().handlers + logger.handlers:
                    handler.flush()
                os.abort()
