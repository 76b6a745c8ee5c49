"""Does cluster launch work on this GPU? Found out in a child process, cached per GPU, driver and library.

The fused one-shot kernel spreads a row over a thread-block cluster (csrc/ar_kernels.cu). Public reports on
compute capability 12.x disagree: TensorRT-LLM gated cluster launch off SM120/121 after "illegal instruction"
failures in its fused all-reduce (PR #13169), while FlashInfer reports clusters and distributed shared memory
working on an RTX 5080 and a DGX Spark (PR #3903). Nothing in this project's CI or GPU machines is SM120, so
the product finds out on the box. An illegal instruction is a sticky error that ends the CUDA context of the
process that hits it, so the check runs the real cluster kernel in a CHILD process (`python -m
sgl_kernel_sm120.cluster_check DEVICE`), on a one-rank workspace, and compares its output bit for bit with the
grouped one-CTA kernel that computes the same bits without a cluster. Whatever happens there (a fault, a hang,
a wrong bit) the caller only reads a verdict; a failed or unknown verdict means "no clusters", which costs speed
(one CTA per row) and never changes a result.

The verdict is cached in `$SGLANG_SM120_CACHE` (default `~/.cache/sglang_sm120`), keyed by the GPU's UUID, the
driver, and the library file (its path, size and mtime), so a server start after the first pays nothing. The
check of one GPU runs under that GPU's own file lock, so ranks sharing a GPU run one check while the ranks of
other GPUs check theirs at the same time; the shared cache file is rewritten under a short lock of its own. A
verdict that says nothing about the GPU (the child did not finish within its bound, or could not start: a busy
or starting machine) is `transient`: it means "no clusters" for this process and is not cached, so the next
start checks again. Switches:
  SGL_SM120_FUSED_CLUSTERS=off          never launch clusters (no check runs)
  SGL_SM120_DEBUG_CLUSTER_CHECK=trap    the child runs a trapping kernel first (the negative control: the caller
                                        must survive, report it and fall back); the cache is neither read nor written
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time

from .env import setting
from .policy import CLUSTER_SIZES

CACHE_ENV = "SGLANG_SM120_CACHE"
SWITCH_ENV = "SGL_SM120_FUSED_CLUSTERS"
DEBUG_ENV = "SGL_SM120_DEBUG_CLUSTER_CHECK"
CHILD_TIMEOUT_S = 120.0
CACHE_FILE = "cluster_check.json"
# Shapes the child runs: rows x hidden, bf16 and fp16; hidden 7168 (Kimi-K2.5) splits unevenly over 8 CTAs.
CHECK_SHAPES = ((1, 7168), (3, 7168), (5, 4096), (2, 2048))


@dataclasses.dataclass(frozen=True)
class ClusterVerdict:
    ok: bool  # every cluster size the device reports capacity for ran and matched the one-CTA kernel
    reason: str  # why not, or how it was found out
    source: str  # "checked" | "cache" | "off" | "debug"
    transient: bool = False  # the check did not get to an answer (timeout, no start): not cached

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def cache_dir(environ=None) -> str:
    env = os.environ if environ is None else environ
    return setting(CACHE_ENV, "", env) or os.path.join(os.path.expanduser("~"), ".cache", "sglang_sm120")


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return "unknown"


def _library_identity(path: str) -> str:
    try:
        st = os.stat(path)
        return f"{path}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        return f"{path}:missing"


def cache_key(uuid: str, library_path: str) -> str:
    return f"{uuid}|{_driver_version()}|{_library_identity(library_path)}"


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def verdict_for(device_index: int, uuid: str, library_path: str, environ=None) -> ClusterVerdict:
    """The verdict for one local GPU: cached, or found out now in a child process (and cached)."""
    env = os.environ if environ is None else environ
    switch = setting(SWITCH_ENV, "auto", env).strip().lower() or "auto"
    if switch not in ("auto", "off"):
        raise ValueError(f"{SWITCH_ENV}={switch!r}: expected auto or off")
    if switch == "off":
        return ClusterVerdict(False, f"cluster launch switched off ({SWITCH_ENV}=off)", "off")
    debug = setting(DEBUG_ENV, "", env).strip()
    folder = cache_dir(env)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, CACHE_FILE)
    key = cache_key(uuid, library_path)
    with open(gpu_lock_path(folder, uuid), "w") as lock:
        # Ranks sharing a GPU: one check at a time, the others read its verdict. The debug check runs under the
        # lock too, so its trapping kernels never run in several processes on one GPU at once.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if debug:
            return _run_child(device_index, debug)
        cached = _read_cache(path).get(key)
        if isinstance(cached, dict) and {"ok", "reason"} <= cached.keys():
            return ClusterVerdict(bool(cached["ok"]), str(cached["reason"]), "cache")
        verdict = _run_child(device_index, "")
        if not verdict.transient:
            _store(path, key, {"ok": verdict.ok, "reason": verdict.reason, "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    return verdict


def gpu_lock_path(folder: str, uuid: str) -> str:
    """The lock one GPU's check runs under (its UUID in the name, made safe for a file name)."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid) or "unknown"
    return os.path.join(folder, f"{CACHE_FILE}.{safe}.lock")


def _store(path: str, key: str, entry: dict) -> None:
    """Add one verdict to the shared cache file: read, update and replace under the file's own lock, held only
    for that, so checks of other GPUs finishing at the same time keep theirs."""
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = _read_cache(path)
        table[key] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def _run_child(device_index: int, debug: str) -> ClusterVerdict:
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = package_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [sys.executable, "-m", "sgl_kernel_sm120.cluster_check", str(device_index)] + ([debug] if debug else [])
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


# ---------------------------------------------------------------------------------------------------------
# The child: `python -m sgl_kernel_sm120.cluster_check DEVICE [trap]`. Prints one JSON line {"ok", "reason"}.
def _child(device_index: int, debug: str) -> dict:
    import torch

    from . import _ext

    ops = _ext.ops()
    torch.cuda.set_device(device_index)
    if debug == "trap":
        ops.debug_trap(device_index)
        torch.cuda.synchronize()  # raises: the context is gone, as after an illegal instruction
    elif debug:
        return {"ok": False, "reason": f"unknown {DEBUG_ENV} value {debug!r}"}
    max_numel = max(rows * hidden for rows, hidden in CHECK_SHAPES)
    handle = ops.ws_create(
        device_index, 0, 1, max_numel, max_numel, 30.0, 30.0, False,
        [0], [0], 0, 0, [], [], 0, 0, 0, "", "", False,
    )
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
                for cluster in sizes:
                    outs = {}
                    for launch in ("cluster", "grouped"):
                        caps = capacity if launch == "cluster" else [0, 0, 0]
                        ops.ws_set_launch_limits(handle, sm_budget, caps)
                        norm, res = torch.empty_like(x), torch.empty_like(x)
                        ops.all_reduce_add_rmsnorm(handle, x, residual, weight, 1e-6, norm, res, 0, sm_budget, False,
                                                   cluster, 0)
                        torch.cuda.synchronize()
                        outs[launch] = (norm.view(torch.int16).clone(), res.view(torch.int16).clone())
                    same = all(torch.equal(a, b) for a, b in zip(outs["cluster"], outs["grouped"], strict=True))
                    expected = (x.float() + residual.float()).to(dtype).view(torch.int16)
                    if not same or not torch.equal(outs["cluster"][1], expected):
                        return {"ok": False, "reason": f"clusters of {cluster} CTAs ran but gave other bits than one "
                                                       f"CTA per row ({dtype}, [{rows}, {hidden}])"}
        return {"ok": True, "reason": f"clusters of {', '.join(map(str, sizes))} CTAs ran and matched one CTA "
                                      f"per row bit for bit"}
    finally:
        ops.ws_destroy(handle)


if __name__ == "__main__":
    _device = int(sys.argv[1])
    _debug = sys.argv[2] if len(sys.argv) > 2 else ""
    print(json.dumps(_child(_device, _debug)), flush=True)
