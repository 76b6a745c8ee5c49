"""sglang_sm120: an overlay that routes SGLang's small tensor-parallel all-reduces (and the fused all-reduce +
residual-add + RMSNorm) to sgl_kernel_sm120's CUDA IPC kernels on PCIe RTX PRO 6000 (SM120) machines.

Importing this package patches nothing; `activate()` does (SGLang calls it through the `sglang.srt.plugins`
entry point in every process). Neither SGLang nor the kernel package is imported until needed.
"""

from __future__ import annotations

from .core.version import __version__

__all__ = ["activate", "deactivate", "is_active", "__version__"]


def __getattr__(name: str):
    """activate, deactivate and is_active of plugin.py, imported on first use (PEP 562)."""
    if name in ("activate", "deactivate", "is_active"):
        from . import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
