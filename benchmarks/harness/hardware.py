"""The hardware and software a result was measured on (no hostname: the result files are committed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from .io import gpu_slug, package_version

# Parts of variable names whose values may name the host or its network: never recorded.
ENV_NOT_RECORDED = ("HOST", "ADDR", "SOCKET", "IB_")


def recordable(name: str) -> bool:
    """Whether an environment variable's value may go into a committed result file."""
    return not any(s in name for s in ENV_NOT_RECORDED)


def _nvidia_smi(query: str) -> list[str] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()] if out.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def driver_version() -> str | None:
    try:
        import pynvml  # type: ignore

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # noqa: BLE001
        pass
    lines = _nvidia_smi("driver_version")
    return lines[0] if lines else None


def nccl_version() -> str | None:
    try:
        import torch

        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001
        return None


# Prefix of every line the benchmarks print in their result tables. Empty on GPUs; cpu_smoke.py sets it so that


def hardware_info(d=None) -> dict:
    import torch

    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    n_vis = torch.cuda.device_count()
    world = d.world_size if d else 1
    p2p = None
    try:
        p2p = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n_vis)] for i in range(n_vis)]
    except Exception:  # noqa: BLE001
        pass
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "SGLANG_SM120", "CUDA_VISIBLE"))}
    env = {k: v for k, v in env.items() if recordable(k)}
    return {
        "gpu": props.name,
        "gpu_slug": gpu_slug(props.name),
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / (1 << 30), 1),
        "gpu_count_visible": n_vis,
        "world_size": world,
        "p2p_access": p2p,
        "driver": driver_version(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "nccl": nccl_version(),
        "python": sys.version.split()[0],
        "versions": {
            k: package_version(k)
            for k in ("triton", "sglang", "flashinfer-python", "sgl-kernel", "sglang-sm120", "apache-tvm-ffi")
        },
        "env": env,
    }
