"""sgl_kernel_sm120: CUDA IPC all-reduce, plain and fused with residual-add + RMSNorm, for small tensors.

Importing this package needs no compiled extension, no GPU (a kernel called without the extension raises
KernelsNotBuiltError with the command that builds it) and no torch: the public names load on first use (PEP 562), so
the overlay reads the pure-Python modules (`policy`, `errors`, `settings`) on machines without torch. This package
knows nothing of SGLang.
"""

from __future__ import annotations

import importlib

_LAZY = {name: module for module, names in {
    "._ext": ["kernels_available"],
    ".errors": ["IpcAllReduceError", "IpcAllReduceHostMemoryError", "IpcAllReduceProbeError",
                "IpcAllReduceTimeoutError", "KernelsNotBuiltError"],
    ".ipc_allreduce": ["IpcAllReduce"],
    ".reference": ["reference_add_rmsnorm", "reference_all_reduce", "reference_all_reduce_add_rmsnorm"],
    ".policy": ["Link", "Memory", "Route", "Schedule", "Transport", "WorkspaceShape", "choose_schedule",
                "describe_schedule", "kernel_limits", "resolve", "seed_route"],
    ".settings": ["KernelSettings", "SettingError"],
}.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value = getattr(importlib.import_module(_LAZY[name], __name__), name)  # later lookups skip this
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
