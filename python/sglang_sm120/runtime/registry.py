"""Where a TP group's backend lives: an attribute of SGLang's GroupCoordinator object, so dispatch, fusion, server
info and the PCIe-IPC coexistence rule find it without importing the module that attached it."""

from __future__ import annotations

from typing import Any

ATTR = "sm120_backend"


def group_backend(group: Any):
    """The TPBackend attached to `group`, or None (not a TP group, mode off, or not attached yet)."""
    return getattr(group, ATTR, None)


def set_group_backend(group: Any, backend: Any) -> None:
    setattr(group, ATTR, backend)
