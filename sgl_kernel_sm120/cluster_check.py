"""Does cluster launch work on this GPU? Public reports disagree on compute capability 12.x, so the box answers
(docs/design.md): the cluster kernel runs against the one-CTA kernel, bit for bit. An illegal instruction ends the
CUDA context that hits it, so the check runs only in a process that may die: the tune's rank processes (before the
server's ranks exist), or a child of the doctor. A serving rank only reads the cached verdict (`cached_verdict`):
none means no clusters, slower and never another result.

Verdicts are cached per GPU, driver and library, under one lock per GPU (ranks sharing a GPU run one check). A
failure that says nothing about the GPU (out of memory, no answer in time, no start) is `transient` and never
cached. debug_cluster_check "trap" makes the check trap first (its negative control); a workspace built under it
sees a failed verdict.
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
# Shapes the check runs: rows x hidden, bf16 and fp16; hidden 7168 (Kimi-K2.5) splits unevenly over 8 CTAs.
CHECK_SHAPES = ((1, 7168), (3, 7168), (5, 4096), (2, 2048))
# A CUDA error of the check's own kernels that is a property of the GPU, driver or library (cached); any other
# error (out of memory, an interrupted process) says nothing about cluster launch and is transient.
KERNEL_FAULTS = ("illegal instruction", "unspecified launch failure", "launch failure", "misaligned address",
                 "illegal address", "device-side assert", "trap", "cluster")


@dataclasses.dataclass(frozen=True)
class ClusterVerdict:
    ok: bool  # every cluster size the device holds ran and matched the one-CTA kernel
    reason: str
    source: str  # "checked" | "cache" | "off" | "debug" | "unchecked"
    transient: bool = False  # no verdict about the GPU: never cached
    context_lost: bool = False  # the check's kernel faulted: this process's CUDA context is unusable


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
    return f"{uuid.removeprefix('GPU-')}|{driver}|{library}"


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_verdict(uuid: str, library_path: str, settings: KernelSettings) -> ClusterVerdict:
    """What a serving rank launches by: the cached verdict of this GPU, driver and library, never a check."""
    if not settings.fused_clusters:
        return ClusterVerdict(False, f"cluster launch switched off ({VARIABLES['fused_clusters']}=off)", "off")
    if settings.debug_cluster_check:
        return ClusterVerdict(False, f"the cluster check fails on purpose ({VARIABLES['debug_cluster_check']}="
                                     f"{settings.debug_cluster_check})", "debug")
    cached = _read_cache(os.path.join(settings.cache_dir, CACHE_FILE)).get(cache_key(uuid, library_path))
    if isinstance(cached, dict) and {"ok", "reason"} <= cached.keys():
        return ClusterVerdict(bool(cached["ok"]), str(cached["reason"]), "cache")
    return ClusterVerdict(False, "cluster launch not checked on this GPU with this driver and library (the tune "
                                 "checks it: python -m sglang_sm120.tune)", "unchecked")


def _locked(settings: KernelSettings, uuid: str):
    """The GPU's own lock file, its UUID in a safe name: one check per GPU at a time (a trapping kernel too)."""
    os.makedirs(settings.cache_dir, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid) or "unknown"
    lock = open(os.path.join(settings.cache_dir, f"{CACHE_FILE}.{safe}.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def _store(settings: KernelSettings, key: str, verdict: ClusterVerdict) -> None:
    path = os.path.join(settings.cache_dir, CACHE_FILE)
    with open(path + ".lock", "w") as table_lock:  # the shared file's own short lock: other GPUs keep theirs
        fcntl.flock(table_lock, fcntl.LOCK_EX)
        table = _read_cache(path)
        table[key] = {"ok": verdict.ok, "reason": verdict.reason, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def check_here(device_index: int, uuid: str, library_path: str, settings: KernelSettings) -> ClusterVerdict:
    """The cached verdict, else the check in THIS process (one that may die: a tune rank, the doctor's child), its
    verdict cached unless transient. A kernel fault leaves this process's CUDA context unusable: the verdict says so
    (`context_lost`) and the caller must end the process."""
    if not settings.fused_clusters:
        return cached_verdict(uuid, library_path, settings)
    with _locked(settings, uuid):
        if not settings.debug_cluster_check:
            found = cached_verdict(uuid, library_path, settings)
            if found.source == "cache":
                return found
        try:
            ok, reason = _check(device_index, settings.debug_cluster_check)
            verdict = ClusterVerdict(ok, reason, "checked")
        except Exception as exc:  # noqa: BLE001 - classified: a property of the GPU, or transient
            text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
            fault = any(word in text.lower() for word in KERNEL_FAULTS)
            verdict = ClusterVerdict(False, f"the cluster check failed ({text})" if fault else
                                     f"the cluster check could not run ({text}; not cached: checked again next time)",
                                     "checked", transient=not fault, context_lost=fault)
        if not verdict.transient and not settings.debug_cluster_check:
            _store(settings, cache_key(uuid, library_path), verdict)
    return verdict


def verdict_for(device_index: int, uuid: str, library_path: str, settings: KernelSettings) -> ClusterVerdict:
    """The cached verdict, else the check in a child process (for a process that must survive it: the doctor)."""
    found = cached_verdict(uuid, library_path, settings)
    if found.source != "unchecked" and not (found.source == "debug" and settings.debug_cluster_check == "trap"):
        return found
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)  # a copy, handed on whole: the child's switches are read by settings.py there
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_parent, env.get("PYTHONPATH"))))
    command = [sys.executable, "-m", "sgl_kernel_sm120.cluster_check", str(device_index)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ClusterVerdict(False, f"the cluster check did not finish within {CHILD_TIMEOUT_S:.0f} s (not cached: "
                                     "checked again next time)", "checked", transient=True)
    except OSError as exc:
        return ClusterVerdict(False, f"the cluster check could not start ({exc})", "checked", transient=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    try:
        return ClusterVerdict(**json.loads(lines[-1]))
    except (IndexError, ValueError, TypeError):
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])[-400:]
        return ClusterVerdict(False, f"the cluster check's process failed (exit code {done.returncode}): {tail}",
                              "checked", transient=True)


def _check(device_index: int, debug: str) -> tuple[bool, str]:
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
            return False, "the device reports no capacity for clusters of 2, 4 or 8 CTAs"
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
                        return False, (f"clusters of {cluster} CTAs ran but gave other bits than one CTA per row "
                                       f"({dtype}, [{rows}, {hidden}])")
        return True, f"clusters of {', '.join(map(str, sizes))} CTAs ran and matched one CTA per row bit for bit"
    finally:
        try:
            ops.ws_destroy(handle)
        except Exception:  # noqa: BLE001 - after a fault: the check's own error is the one to report
            pass


if __name__ == "__main__":
    import torch as _torch

    from . import _ext as _lib
    from .settings import read as _read

    _index = int(sys.argv[1])
    _uuid = str(_torch.cuda.get_device_properties(_index).uuid)
    print(json.dumps(dataclasses.asdict(check_here(_index, _uuid, _lib.library_path(), _read()))), flush=True)
