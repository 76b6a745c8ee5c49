"""sgl_kernel_sm120: CUDA IPC all-reduce, plain and fused with residual-add + RMSNorm, for small tensors.

Importing this package never needs the compiled extension or a GPU; calling a kernel without the
extension raises KernelsNotBuiltError with the command that builds it. This package knows nothing of SGLang.
"""

from ._ext import kernels_available
from .errors import (
    IpcAllReduceError,
    IpcAllReduceHostMemoryError,
    IpcAllReduceProbeError,
    IpcAllReduceTimeoutError,
    KernelsNotBuiltError,
)
from .ipc_allreduce import IpcAllReduce
from .reference import reference_add_rmsnorm, reference_all_reduce, reference_all_reduce_add_rmsnorm
from .variants import Link, Transport, Variant, choose_transport, choose_variant, describe_schedule

__all__ = [
    "IpcAllReduce",
    "IpcAllReduceError",
    "IpcAllReduceHostMemoryError",
    "IpcAllReduceProbeError",
    "IpcAllReduceTimeoutError",
    "KernelsNotBuiltError",
    "Link",
    "Transport",
    "Variant",
    "choose_transport",
    "choose_variant",
    "describe_schedule",
    "kernels_available",
    "reference_add_rmsnorm",
    "reference_all_reduce",
    "reference_all_reduce_add_rmsnorm",
]
