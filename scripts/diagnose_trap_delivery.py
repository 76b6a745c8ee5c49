"""Does a kernel trap reach every process when several ranks share one GPU? (the trap mode of a timeout relies on it)

Held-out runs with 8 ranks time-slicing one H200 saw every waiting rank record its timeout, most of them raise,
and one or more stay inside torch.cuda.synchronize() for minutes. This script reproduces that situation and
records what each rank saw, so the cause is named by evidence rather than guessed:

  W ranks (processes) share the visible GPU(s); the last rank skips call #1 of a trap-mode workspace
  (on_timeout="trap"), so W-1 ranks time out and trap at about the same moment. Each rank reports, through a
  queue, when its call started and when (and with what) its synchronize returned or raised. A rank that reports
  nothing by the deadline is listed as hung (alive) or by its exit code (-6: aborted by the watchdog backstop,
  SGL_SM120_AR_ABORT_AFTER_S). The kernel log (`dmesg`, Xid lines) is attached where readable.

    python scripts/diagnose_trap_delivery.py --world 8 --abort-after 0 --out trap_w8.json    # backstop off
    python scripts/diagnose_trap_delivery.py --world 8 --abort-after 5 --out trap_w8_abort.json

Timings are wall-clock seconds from the moment the waiting ranks launched the call.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, timeout_s: float, queue) -> None:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    from sgl_kernel_sm120 import IpcAllReduce, Schedule

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ar = IpcAllReduce(dist.group.WORLD, torch.cuda.current_device(), 64 * 7168, timeout_s=timeout_s,
                      on_timeout="trap")
    x = torch.ones(3, 7168, dtype=torch.bfloat16, device="cuda")
    ar.all_reduce(x, schedule=Schedule.ONESHOT)
    torch.cuda.synchronize()
    dist.barrier()
    start = time.monotonic()
    if rank == world - 1:
        queue.put((rank, "skipped", 0.0, ""))
        time.sleep(timeout_s + 60.0)  # stay alive (its slab stays mapped) while the others time out
        return
    queue.put((rank, "launched", 0.0, ""))
    ar.all_reduce(x, schedule=Schedule.ONESHOT)
    try:
        torch.cuda.synchronize()
        queue.put((rank, "returned", time.monotonic() - start, "synchronize returned without an error"))
    except Exception as exc:  # the trap's CUDA error
        record = ar.timeout_error()
        queue.put((rank, "raised", time.monotonic() - start, f"{type(exc).__name__}: {str(exc)[:200]} | record: "
                                                             f"{record}"))
    time.sleep(2.0)
    os._exit(0)  # the context is gone; skip teardown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=5.0, help="the kernel's wait bound, seconds")
    parser.add_argument("--abort-after", type=float, default=0.0, help="SGL_SM120_AR_ABORT_AFTER_S (0: off)")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds to wait for reports")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["SGL_SM120_AR_ABORT_AFTER_S"] = str(args.abort_after)

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.timeout, queue)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    events: dict[int, list] = {r: [] for r in range(args.world)}
    deadline = time.monotonic() + args.deadline + args.timeout
    while time.monotonic() < deadline:
        try:
            rank, what, at, detail = queue.get(timeout=0.5)
            events[rank].append({"event": what, "at_s": round(at, 2), "detail": detail})
        except Exception:
            pass
        finals = [any(e["event"] in ("raised", "returned", "skipped") for e in events[r]) for r in range(args.world)]
        if all(finals) and all(not p.is_alive() for p in procs[:-1]):
            break
    outcome = {}
    for rank, proc in enumerate(procs):
        kinds = [e["event"] for e in events[rank]]
        if "skipped" in kinds:
            state = "skipped the call (the peer the others wait for)"
        elif "raised" in kinds or "returned" in kinds:
            state = kinds[-1]
        elif proc.is_alive():
            state = "HUNG: no error within the deadline, process alive"
        else:
            state = f"exited with code {proc.exitcode} without reporting"
        outcome[rank] = {"state": state, "events": events[rank], "exitcode": proc.exitcode}
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    dmesg = subprocess.run(["sh", "-c", "dmesg 2>&1 | grep -i -E 'xid|nvrm' | tail -n 40"], capture_output=True,
                           text=True)
    result = {
        "world": args.world,
        "kernel_timeout_s": args.timeout,
        "abort_after_s": args.abort_after,
        "ranks": outcome,
        "dmesg_xid": dmesg.stdout.strip().splitlines(),
        "note": "ranks share the visible GPU(s); timings are wall-clock from the launch of the call",
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for rank, entry in outcome.items():
        print(f"rank {rank}: {entry['state']} {entry['events'][-1] if entry['events'] else ''}")
    print("dmesg:", *result["dmesg_xid"][-10:], sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
