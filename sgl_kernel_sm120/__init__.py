"""sgl_kernel_sm120: CUDA IPC all-reduce, plain and fused with residual-add + RMSNorm, for small tensors.

Importing this package never needs the compiled extension or a GPU; calling a kernel without the
extension raises KernelsNotBuiltError with the command that builds it. This package knows nothing of SGLang.

The public names are loaded on first use (PEP 562), so the pure-Python modules (`policy`, `errors`, `settings`)
import without torch: the overlay reads them on machines that have no torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "kernels_available": "._ext",
    "IpcAllReduceError": ".errors",
    "IpcAllReduceHostMemoryError": ".errors",
    "IpcAllReduceProbeError": ".errors",
    "IpcAllReduceTimeoutError": ".errors",
    "KernelsNotBuiltError": ".errors",
    "IpcAllReduce": ".ipc_allreduce",
    "reference_add_rmsnorm": ".reference",
    "reference_all_reduce": ".reference",
    "reference_all_reduce_add_rmsnorm": ".reference",
    "Link": ".policy",
    "Memory": ".policy",
    "Route": ".policy",
    "Transport": ".policy",
    "Schedule": ".policy",
    "WorkspaceShape": ".policy",
    "choose_schedule": ".policy",
    "describe_schedule": ".policy",
    "kernel_limits": ".policy",
    "seed_route": ".policy",
    "resolve": ".policy",
    "KernelSettings": ".settings",
    "SettingError": ".settings",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
