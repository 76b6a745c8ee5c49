"""Rank 0's half of a host-memory workspace construction, alone in this process: where ws_create dies natively
while creating the shared file, Python's faulthandler shows only the op call. Run under cuda-gdb for the native
stack:

    cuda-gdb -q -batch -ex run -ex bt --args python3 scripts/diagnose_hostmem_create.py [max_numel]

The creating rank needs no peer for this step (its peers map the file afterwards), so one process reproduces it.
Prints each outcome; the file is removed at the end."""

from __future__ import annotations

import os
import secrets
import sys

import torch

from sgl_kernel_sm120 import _ext
from sgl_kernel_sm120.construction import placement
from sgl_kernel_sm120.policy import Memory
from sgl_kernel_sm120.settings import read


def main() -> int:
    max_numel = int(sys.argv[1]) if len(sys.argv) > 1 else 257 * 7168
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.cuda.set_device(0)
    shm_dir = read().shm_dir
    ops = _ext.ops()
    need = int(ops.host_shared_bytes_for(world, max_numel, max_numel))
    print(f"creating a {world}-rank host workspace of {max_numel} elements: {need} B in {shm_dir}", flush=True)
    name = f"sgl_sm120_diag_{os.getpid()}_{secrets.token_hex(4)}"
    flat = placement([list(range(world))], 0)
    handle = ops.ws_create(0, 0, world, max_numel, max_numel, 30.0, 10.0, False, *flat, [], [], 0, 0,
                           Memory.HOST.code, shm_dir, name, True)
    print("ws_create returned; numa:", list(ops.ws_host_numa(handle)), flush=True)
    ops.ws_unlink_shared(handle)
    ops.ws_destroy(handle)
    print("destroyed", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
