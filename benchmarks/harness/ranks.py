"""The ranks of a torchrun benchmark: launch checks, the NCCL group plus one gloo group for all host
coordination, agreement (`Dist.agree`, `Dist.attempt`: every decision that can differ between ranks is made
locally, then agreed before the next collective), a watchdog, teardown, and the health and bit-equality checks
after a step."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from .io import short_exc


class NotEnoughGPUs(SystemExit):
    pass


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: Any  # torch.device
    gloo: Any  # ProcessGroup (gloo) for host-side coordination
    nccl: Any  # the default (NCCL) group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_obj(self, obj: Any) -> list:
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.gloo)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.gloo)

    def agree(self, ok: bool, reason: str | None = None) -> tuple[bool, str | None]:
        """All ranks learn whether every rank succeeded; returns (all_ok, combined reason)."""
        votes = self.all_gather_obj((bool(ok), reason))
        if all(v[0] for v in votes):
            return True, None
        reasons: dict[str, list[int]] = {}
        for r, (good, why) in enumerate(votes):
            if not good:
                reasons.setdefault(why or "failed", []).append(r)
        parts = [f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {why}" for why, rs in reasons.items()]
        return False, "; ".join(parts)

    def attempt(self, fn: Callable[[], Any], what: str = "") -> tuple[bool, Any, str | None]:
        """Run a *local* (collective-free) step on every rank, then agree. Returns (ok, value, reason)."""
        try:
            value = fn()
            ok, why = True, None
        except Exception as e:  # noqa: BLE001
            value, ok, why = None, False, (f"{what}: " if what else "") + short_exc(e)
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
        all_ok, reason = self.agree(ok, why)
        return all_ok, (value if all_ok else None), reason

    def log(self, msg: str, all_ranks: bool = False) -> None:
        if all_ranks or self.is_main:
            prefix = f"[rank {self.rank}] " if all_ranks else ""
            print(prefix + msg, flush=True)


def world_size_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def require_multi_gpu(script: str, min_world: int = 2) -> None:
    """Exit with a clear message (and no numbers) when not launched on >= min_world GPUs."""
    ws = world_size_from_env()
    if ws < min_world:
        msg = (
            f"{script}: needs at least {min_world} ranks/GPUs (got WORLD_SIZE={ws}). Launch with "
            f"`torchrun --nproc-per-node N {script}` for N in 2, 4, 8. No numbers were produced."
        )
        print(msg, file=sys.stderr, flush=True)
        raise NotEnoughGPUs(2)
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        print(f"{script}: CUDA is not available. No numbers were produced.", file=sys.stderr, flush=True)
        raise NotEnoughGPUs(2)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ws))
    if torch.cuda.device_count() < local_world:
        print(
            f"{script}: {local_world} local ranks but only {torch.cuda.device_count()} visible GPU(s); one GPU per "
            "rank is required. No numbers were produced.",
            file=sys.stderr,
            flush=True,
        )
        raise NotEnoughGPUs(2)


def init_distributed(gloo_timeout_s: float = 1800.0) -> Dist:
    import datetime

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl", device_id=device)
        except TypeError:  # very old torch: no device_id
            dist.init_process_group("nccl")
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=gloo_timeout_s))
    d = Dist(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        gloo=gloo,
        nccl=dist.group.WORLD,
    )
    # Warm the NCCL communicator eagerly (graph capture needs it initialised).
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return d


def check_same_args(d: Dist, args_dict: dict) -> None:
    """All ranks must run the same pinned configuration (sizes, iteration counts...)."""
    digest = hashlib.sha1(json.dumps(args_dict, sort_keys=True, default=str).encode()).hexdigest()
    digests = d.all_gather_obj(digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks were launched with different arguments: {digests}")


def shutdown(d: Dist | None, exit_after_s: float | None = None) -> None:
    """Barrier and tear down. Results are written before this: if a peer's IPC/NCCL teardown hangs (seen once
    on 2x H200 after a complete run), a command-line run exits anyway after exit_after_s (never armed when
    main() is called in-process, e.g. by tests)."""
    import torch.distributed as dist

    def force_exit() -> None:
        time.sleep(exit_after_s)
        print(f"teardown did not finish within {exit_after_s:.0f} s; exiting (results were already written)",
              flush=True)
        os._exit(0)

    if exit_after_s is not None:
        threading.Thread(target=force_exit, daemon=True, name="bench-teardown").start()
    try:
        if d is not None:
            d.barrier()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class Watchdog:
    """Ends a run that exceeds its time limit (a peer kernel that spins forever), after ``on_timeout`` (which
    rank 0 uses to write the partial results). 0 disables it."""

    def __init__(self, seconds: float, on_timeout: Callable[[], None] | None = None) -> None:
        self.seconds = float(seconds or 0)
        self.on_timeout = on_timeout
        self._done = threading.Event()
        self.t0 = time.monotonic()
        if self.seconds > 0:
            threading.Thread(target=self._run, daemon=True, name="bench-watchdog").start()

    def _run(self) -> None:
        if self._done.wait(self.seconds):
            return
        print(f"[watchdog] time limit of {self.seconds:.0f} s exceeded; writing partial results and exiting",
              file=sys.stderr, flush=True)
        try:
            if self.on_timeout:
                self.on_timeout()
        finally:
            os._exit(124)

    def stop(self) -> None:
        self._done.set()


def cuda_healthy(d: Dist) -> tuple[bool, str | None]:
    """After a failure: is every rank's CUDA context still usable (no sticky error)?"""
    import torch

    def probe():
        t = torch.ones(4, device=d.device)
        t.add_(1)
        torch.cuda.synchronize()
        if float(t.sum()) != 8.0:
            raise RuntimeError("probe kernel gave a wrong answer")

    ok, _, why = d.attempt(probe, "CUDA health probe")
    return ok, why


def tensor_digest(t: Any) -> str:
    import torch

    v = t.detach().contiguous()
    if v.dtype in (torch.bfloat16, torch.float16):
        v = v.view(torch.int16)
    return hashlib.sha1(v.cpu().numpy().tobytes()).hexdigest()


def bitwise_equal_across_ranks(d: Dist, t: Any) -> bool:
    return len(set(d.all_gather_obj(tensor_digest(t)))) == 1
