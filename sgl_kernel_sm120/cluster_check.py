"""Does cluster launch work on this GPU? Public reports disagree on compute capability 12.x, so the box answers
(docs/design.md): an illegal instruction ends the CUDA context that hits it, so a child process runs the cluster
kernel and compares it bit for bit with the one-CTA kernel. A failed or unknown verdict means no clusters: slower,
never another result. Verdicts are cached per GPU, driver and library under one lock per GPU (ranks sharing a GPU
run one check, other GPUs check at once), except a `transient` one that says nothing about the GPU (no answer in
time, no start); debug_cluster_check "trap" makes the child trap first (the negative control), past the cache.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time

from .policy import CLUSTER_SIZES, Memory, Schedule, Transport
from .settings import VARIABLES, KernelSettings

CHILD_TIMEOUT_S = 120.0
CACHE_FILE = "cluster_check.json"
# Shapes the child runs: rows x hidden, bf16 and fp16; hidden 7168 (Kimi-K2.5) splits unevenly over 8 CTAs.
CHECK_SHAPES = ((1, 7168), (3, 7168), (5, 4096), (2, 2048))


@dataclasses.dataclass(frozen=True)
class ClusterVerdict:
    ok: bool  # every cluster size the device holds ran and matched the one-CTA kernel
    reason: str
    source: str  # "checked" | "cache" | "off" | "debug"
    transient: bool = False  # no answer (timeout, no start): not cached


def cache_key(uuid: str, library_path: str) -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            driver = f.readline().strip()
    except OSError:
        driver = "unknown"
    try:
        st = os.stat(library_path)
        library = f"{library_path}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        library = f"{library_path}:missing"
    return f"{uuid}|{driver}|{library}"


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def verdict_for(device_index: int, uuid: str, library_path: str, settings: KernelSettings) -> ClusterVerdict:
    """The verdict for one local GPU: cached, or found out now in a child process (and cached)."""
    if not settings.fused_clusters:
        return ClusterVerdict(False, f"cluster launch switched off ({VARIABLES['fused_clusters']}=off)", "off")
    os.makedirs(settings.cache_dir, exist_ok=True)
    path, key = os.path.join(settings.cache_dir, CACHE_FILE), cache_key(uuid, library_path)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid) or "unknown"
    with open(f"{path}.{safe}.lock", "w") as lock:  # the GPU's own lock, its UUID in a safe name
        fcntl.flock(lock, fcntl.LOCK_EX)  # the debug check too: trapping kernels never run in two processes at once
        if settings.debug_cluster_check:
            return _run_child(device_index, settings.debug_cluster_check)
        cached = _read_cache(path).get(key)
        if isinstance(cached, dict) and {"ok", "reason"} <= cached.keys():
            return ClusterVerdict(bool(cached["ok"]), str(cached["reason"]), "cache")
        verdict = _run_child(device_index, "")
        if verdict.transient:
            return verdict
        with open(path + ".lock", "w") as table_lock:  # the shared file's own short lock: other GPUs keep theirs
            fcntl.flock(table_lock, fcntl.LOCK_EX)
            table = _read_cache(path)
            table[key] = {"ok": verdict.ok, "reason": verdict.reason, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    return verdict


def _run_child(device_index: int, debug: str) -> ClusterVerdict:
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)  # a copy, handed on whole: the child's switches are read by settings.py there
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_parent, env.get("PYTHONPATH"))))
    command = [sys.executable, "-m", "sgl_kernel_sm120.cluster_check", str(device_index), *([debug] if debug else [])]
    source = "debug" if debug else "checked"
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ClusterVerdict(False, f"the cluster check did not finish within {CHILD_TIMEOUT_S:.0f} s (not cached: "
                                     "checked again at the next start)", source, transient=True)
    except OSError as exc:
        return ClusterVerdict(False, f"the cluster check could not start ({exc})", source, transient=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        try:
            result = json.loads(lines[-1])
            return ClusterVerdict(bool(result["ok"]), str(result["reason"]), source)
        except (ValueError, KeyError):
            pass
    tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])[-400:]
    return ClusterVerdict(False, f"the cluster check failed (exit code {done.returncode}): {tail}", source)


def _child(device_index: int, debug: str) -> dict:
    """The child's verdict as {"ok", "reason"} (printed as one JSON line)."""
    import torch

    from . import _ext

    ops = _ext.ops()
    torch.cuda.set_device(device_index)
    if debug == "trap":
        ops.debug_trap(device_index)
        torch.cuda.synchronize()  # raises: the context is gone, as after an illegal instruction
    max_numel = max(rows * hidden for rows, hidden in CHECK_SHAPES)
    # rank 0 of 1, exit mode on timeout, one island of itself, no islands (csrc/torch_bindings.cpp ws_create)
    handle = ops.ws_create(device_index, 0, 1, max_numel, max_numel, 30.0, 30.0, False, [0], [0], 0, 0, [], [], 0, 0,
                           Memory.DEVICE.code, "", "", False)
    try:
        capacity = [int(c) for c in ops.ws_cluster_capacity(handle)]
        sizes = [c for c, cap in zip(CLUSTER_SIZES, capacity, strict=True) if cap > 0]
        if not sizes:
            return {"ok": False, "reason": "the device reports no capacity for clusters of 2, 4 or 8 CTAs"}
        sm_budget = int(ops.ws_sm_count(handle))
        generator = torch.Generator().manual_seed(1234)
        for dtype in (torch.bfloat16, torch.float16):
            for rows, hidden in CHECK_SHAPES:
                def ints(*shape, low=-8, high=9, dtype=dtype):
                    return torch.randint(low, high, shape, generator=generator).to(dtype).cuda()

                x, residual, weight = ints(rows, hidden), ints(rows, hidden), ints(hidden, low=1, high=4)
                expected = (x.float() + residual.float()).to(dtype).view(torch.int16)
                for cluster in sizes:
                    outs = []  # norm and residual rows, as bits: the cluster kernel's, then the one-CTA kernel's
                    for caps in (capacity, [0] * len(capacity)):
                        ops.ws_set_launch_limits(handle, sm_budget, caps)
                        norm, res = torch.empty_like(x), torch.empty_like(x)
                        ops.all_reduce_add_rmsnorm(handle, x, residual, weight, 1e-6, norm, res,
                                                   int(Schedule.ONESHOT), sm_budget, False, cluster,
                                                   Transport.PUSH.code)
                        torch.cuda.synchronize()
                        outs.append(torch.cat([norm, res]).view(torch.int16))
                    if not torch.equal(*outs) or not torch.equal(outs[0][rows:], expected):
                        return {"ok": False, "reason": f"clusters of {cluster} CTAs ran but gave other bits than one "
                                                       f"CTA per row ({dtype}, [{rows}, {hidden}])"}
        return {"ok": True, "reason": f"clusters of {', '.join(map(str, sizes))} CTAs ran and matched one CTA "
                                      f"per row bit for bit"}
    finally:
        ops.ws_destroy(handle)


if __name__ == "__main__":
    print(json.dumps(_child(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")), flush=True)
