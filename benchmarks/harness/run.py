"""The life of one torchrun benchmark run, shared by bench_allreduce.py and bench_verify.py.

`main` is every entry's `main()`: refuse to run without the GPUs (no numbers), set up NCCL's P2P mode before NCCL
starts, start the ranks, check that every rank got the same arguments, run under a watchdog that writes what it
has when the time limit ends the run, and tear down. `Run` is what every run keeps: its result file (rewritten by
rank 0 after every step, so a killed run leaves `"complete": false`), the skipped steps and their reasons, and
the CUDA health check after a failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import hardware, io, nccl_mode, ranks


class Abort(Exception):
    """The run cannot go on: a failure left a rank's CUDA context unusable."""


class Run:
    """Subclasses name their result `kind` (the file's prefix), build the document (`doc`) and check it
    (`validate`, raising on a schema slip)."""

    kind = "?"

    def __init__(self, d: ranks.Dist, args, mode: dict | None = None):
        self.d, self.args = d, args
        self.no_p2p = bool(getattr(args, "no_p2p", False))
        self.nccl_mode = mode if mode is not None else {"mode": "no_p2p" if self.no_p2p else "default",
                                                        "no_p2p": self.no_p2p}
        self.skipped: list[dict] = []
        self.hw = hardware.hardware_info(d)
        self.t0 = time.monotonic()
        self.complete = False
        self.aborted: str | None = None
        tag = "shared" if getattr(self, "shared", False) else nccl_mode.output_tag(self.no_p2p)
        self.out_json = io.result_path(Path(args.out), self.kind, self.hw["gpu"], d.world_size, tag=tag)

    def doc(self) -> dict:
        raise NotImplementedError

    def validate(self, doc: Mapping) -> None:
        raise NotImplementedError

    def write(self) -> None:
        if not self.d.is_main:
            return
        doc = self.doc()
        try:
            self.validate(doc)
        except Exception as e:  # noqa: BLE001 - never lose the numbers over a schema slip
            doc["schema_error"] = io.short_exc(e)
        io.write_json(self.out_json, doc)

    def skip(self, impl: str, reason: str, **extra) -> None:
        self.skipped.append({"impl": impl, "reason": reason or "unknown", **extra})
        self.d.log(f"  skip {impl} {extra if extra else ''}: {reason}")

    def check_health(self) -> None:
        """After a failed step: go on only if every rank's CUDA context is still usable."""
        ok, why = ranks.cuda_healthy(self.d)
        if not ok:
            self.aborted = f"CUDA context unusable after a failure: {why}"
            raise Abort(self.aborted)

    def run(self) -> None:
        raise NotImplementedError


def main(script: str, args, uses_nccl_label: bool, make_run: Callable[[ranks.Dist, Any, dict], Run],
         in_process: bool, init: Callable[[str], ranks.Dist] | None = None) -> int:
    """Run one benchmark under torchrun. `uses_nccl_label`: the run records results under an NCCL name.
    `in_process`: called from Python (tests), so a hanging teardown is never cut short by exiting. `init`: starts
    the ranks another way than ranks.init_distributed (bench_verify --shared-gpu: gloo only, GPUs shared)."""
    if init is None:
        ranks.require_multi_gpu(script)
    # Before init_distributed: NCCL reads NCCL_P2P_DISABLE when it creates its first communicator.
    mode = nccl_mode.enter_nccl_mode(script, args.no_p2p, uses_nccl_label=uses_nccl_label)
    d = init(script) if init is not None else ranks.init_distributed()
    try:
        ranks.check_same_args(d, vars(args))
        run = make_run(d, args, mode)
        watchdog = ranks.Watchdog(args.time_limit, on_timeout=run.write)
        run.run()
        watchdog.stop()
    finally:
        ranks.shutdown(d, exit_after_s=None if in_process else 60.0)
        nccl_mode.cleanup_nccl_log(mode)
    return 0
