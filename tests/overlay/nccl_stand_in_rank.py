"""A stand-in for one rank process of sglang_sm120.nccl_check, for the CPU tests (no CUDA, no NCCL): it reads the
command line run() gives a rank with nccl_check's own parser, and does what STAND_IN_MODE (environment) says.
ok: writes NCCL 2.28.9's lines into NCCL_DEBUG_FILE (init.cc:608; transport/p2p.cc:393 when its environment lets
P2P cross the CPU, else transport/shm.cc:128) and stand-in times (base + rank + replay % 3 us, base 20 with P2P,
200 without); wrong: as ok, but rank 1 finds NCCL's results wrong through P2P; hang: sleeps; crash: rank 1 fails
at once while the others hang, as NCCL's would."""

from __future__ import annotations

import os
import sys
import time

from sglang_sm120 import nccl_check
from sglang_sm120.core import nccl


def main() -> int:
    a, mode = nccl_check.parser().parse_args(), os.environ["STAND_IN_MODE"]
    assert a.rank is not None and a.port > 0 and os.path.isdir(a.out), "not a rank's command line"
    if mode == "hang" or (mode == "crash" and a.rank != 1):
        time.sleep(3600)
    if mode == "crash":
        print("stand-in rank failing")
        return 3
    p2p = nccl.p2p_level_is_sys(os.environ) and not nccl.p2p_disabled(os.environ)
    peer, prefix = (a.rank + 1) % a.world, f"stand-in:{os.getpid()}:1 [{a.rank}] NCCL INFO "
    with open(os.environ["NCCL_DEBUG_FILE"], "w") as f:
        f.write(f"{prefix}NCCL version 2.28.9+cuda13.0\n")
        for c in range(2):
            link = f"{a.rank}[{a.rank}] -> {peer}[{peer}]"
            f.write(f"{prefix}Channel {c:02d}/0 : {link} via P2P/CUMEM/read\n" if p2p else
                    f"{prefix}Channel {c:02d} : {link} via SHM/direct/direct\n")
    ar, ag = nccl_check.labels(a.hidden, a.vocab, a.world)
    base = 20.0 if p2p else 200.0
    times = {s: [base + a.rank + i % 3 for i in range(nccl_check.REPLAYS)] for s in [*ar, ag]}
    wrong = [*ar, ag] if mode == "wrong" and p2p and a.rank == 1 else []
    nccl_check.write_times(a, times, True if a.rank == 0 else None, wrong)
    return 0


if __name__ == "__main__":
    sys.exit(main())
