"""One seam table per supported SGLang version; the installed version picks it, others are refused."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from types import ModuleType

# version string (as importlib.metadata reports it) -> module holding SEAMS
SEAM_TABLES = {
    "0.5.13.post1": "sglang_sm120.seams.v0_5_13_post1",
    "0.5.23": "sglang_sm120.seams.v0_5_23",
}


class UnsupportedSGLangVersion(RuntimeError):
    pass


def sglang_version() -> str:
    """The installed SGLang's version (tests monkeypatch this)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        from sglang.version import __version__

        return __version__


def load_table(version: str | None = None) -> ModuleType:
    version = sglang_version() if version is None else version
    module_name = SEAM_TABLES.get(version)
    if module_name is None:
        raise UnsupportedSGLangVersion(
            f"sglang_sm120 has no seam table for sglang {version}; supported: {', '.join(sorted(SEAM_TABLES))}. "
            "Install a supported sglang, or leave the overlay out (uninstall sglang-sm120, or name only other "
            "plugins in SGLANG_PLUGINS)."
        )
    table = importlib.import_module(module_name)
    # Names the hooks read but do not patch (a table's READS): a missing one would make a hook take a
    # wrong branch at run time, so it is an activation error like a missing seam.
    from .base import check_resolvable

    check_resolvable(list(getattr(table, "READS", ())))
    return table


def set_server_nccl() -> tuple[str, str]:
    """Set the NCCL_* variables the installed SGLang's launcher sets for a server (a table's key holds them) where
    this process has none: (SGLang's version, those set as "NAME=value ..."); ("", "") without a supported SGLang."""
    try:
        table = load_table()
    except (UnsupportedSGLangVersion, ImportError, AttributeError):
        return "", ""
    unset = {k: v for k, v in table.SERVER_NCCL.items() if k not in os.environ}
    os.environ.update(unset)
    return table.SGLANG_VERSION, " ".join(f"{k}={v}" for k, v in unset.items())
