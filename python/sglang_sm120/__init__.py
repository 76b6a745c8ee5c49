"""sglang_sm120: an overlay that routes SGLang's small tensor-parallel all-reduces (and the fused all-reduce +
residual-add + RMSNorm) to sgl_kernel_sm120's CUDA IPC kernels on PCIe RTX PRO 6000 (SM120) machines.

Importing this package patches nothing; `activate()` does (SGLang calls it through the `sglang.srt.plugins`
entry point in every process). Neither SGLang nor the kernel package is imported until needed.
"""

from __future__ import annotations

from .core.version import __version__


def activate() -> None:
    from .plugin import activate as _activate

    _activate()


def deactivate() -> None:
    from .plugin import deactivate as _deactivate

    _deactivate()


def is_active() -> bool:
    from .plugin import is_active as _is_active

    return _is_active()


__all__ = ["activate", "deactivate", "is_active", "__version__"]
