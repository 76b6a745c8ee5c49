"""Loads the compiled extension once and says how to build it when it is missing."""

from __future__ import annotations

import functools
import os

import torch

from .errors import KernelsNotBuiltError

BUILD_HINT = (
    "sgl_kernel_sm120._C is not built. Build it on a machine with a CUDA build of torch and nvcc: "
    "`CUDA_HOME=/usr/local/cuda pip install --no-build-isolation -e .` from the sglang-sm120 checkout "
    "(TORCH_CUDA_ARCH_LIST picks the GPU architectures, default 12.0a plus the visible GPUs)."
)


# Load this library instead of the packaged `_C`: used by the protocol negative-control tests, which build
# the same sources with a protocol invariant broken on purpose (tests/gpu/test_negative_controls.py).
LIBRARY_OVERRIDE_ENV = "SGL_SM120_EXT_LIBRARY"


@functools.lru_cache(maxsize=1)
def _load() -> tuple[object | None, str]:
    override = os.environ.get(LIBRARY_OVERRIDE_ENV)
    try:
        if override:
            torch.ops.load_library(override)
        else:
            from . import _C  # noqa: F401  (registers torch.ops.sgl_kernel_sm120)
    except (ImportError, OSError) as exc:
        return None, f"{BUILD_HINT} Loading {override or '_C'} failed with: {exc}"
    return torch.ops.sgl_kernel_sm120, ""


def kernels_available() -> bool:
    """True when the compiled kernels can be loaded (a GPU is not required to load them)."""
    return _load()[0] is not None


def ops():
    """The torch ops namespace of the extension; raises KernelsNotBuiltError with the build command."""
    namespace, why = _load()
    if namespace is None:
        raise KernelsNotBuiltError(why)
    return namespace
