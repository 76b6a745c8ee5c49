"""Loads the compiled extension built for the running torch, and says exactly why when it cannot."""

from __future__ import annotations

import functools
import glob
import importlib
import importlib.machinery
import os

import torch

from . import _abi, settings
from .errors import KernelsNotBuiltError

BUILD_HINT = (
    "Build them in this environment, from the sglang-sm120 checkout, on a machine with nvcc whose major version "
    "is torch's CUDA major (export CUDA_HOME=/usr/local/cuda): `pip install --no-build-isolation -e .` with this "
    "environment's torch; TORCH_CUDA_ARCH_LIST picks the GPU architectures (default 12.0a plus the visible GPUs). "
    "(`make build` builds only for the checkout's test environments under .venvs/, which this one does not load.)"
)


def expected_module() -> str:
    return _abi.extension_module(torch.__version__, torch.version.cuda)


def missing_reason(package_dir: str = os.path.dirname(os.path.abspath(__file__))) -> str:
    """Why there is no library for this torch: none at all, or only ones built for another torch."""
    here = f"torch {torch.__version__.split('+')[0]}, CUDA {torch.version.cuda or 'none'}"
    libraries = [os.path.basename(path) for path in glob.glob(os.path.join(package_dir, _abi.PREFIX + "*"))
                 if path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))]
    if libraries:  # a module name has no dot (_abi), so its file's suffix begins at the first
        built_for = "; ".join(_abi.describe_tag(name) for name in sorted({f.split(".")[0] for f in libraries}))
        return (f"sgl_kernel_sm120's kernels were built for another torch ({built_for}); this environment runs "
                f"{here}. {BUILD_HINT}")
    return f"sgl_kernel_sm120's kernels are not built (no {expected_module()} for {here}). {BUILD_HINT}"


@functools.lru_cache(maxsize=1)
def _load() -> tuple[object | None, str, str]:
    """(the ops namespace or None, why not, the library's file)."""
    override = settings.read().library  # a negative-control build (tests/gpu/negative_builds.py)
    if override:
        try:
            torch.ops.load_library(override)
        except (ImportError, OSError) as exc:
            return None, f"loading {override} ({settings.VARIABLES['library']}) failed: {exc}", ""
        return torch.ops.sgl_kernel_sm120, "", os.path.abspath(override)
    name = expected_module()
    try:
        module = importlib.import_module(f"{__package__}.{name}")  # registers torch.ops.sgl_kernel_sm120
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.{name}":
            return None, f"loading sgl_kernel_sm120.{name} failed: {exc}", ""
        return None, missing_reason(), ""
    except (ImportError, OSError) as exc:
        return None, f"sgl_kernel_sm120.{name} exists but does not load: {exc}. {BUILD_HINT}", ""
    return torch.ops.sgl_kernel_sm120, "", os.path.abspath(module.__file__)


def library_path() -> str:
    """The file of the loaded library (the override, or the packaged module for this torch)."""
    ops()
    return _load()[2]


def kernels_available() -> bool:
    """True when the compiled kernels can be loaded (a GPU is not required to load them)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """None when the kernels load, else the one-paragraph reason (what is missing and how to build it)."""
    return _load()[1] or None


def ops():
    """The torch ops namespace of the extension; raises KernelsNotBuiltError saying what is missing."""
    namespace, why, _ = _load()
    if namespace is None:
        raise KernelsNotBuiltError(why)
    return namespace
