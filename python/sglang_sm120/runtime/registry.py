"""Where a TP group's sm120 backend lives: an attribute of SGLang's GroupCoordinator object.

The hooks attach the communicator when the group is built and everyone else (dispatch, fusion, server info, the
PCIe-IPC coexistence rule) looks it up here, so none of them has to import the module that attached it.
"""

from __future__ import annotations

from typing import Any

ATTR = "sm120_comm"


def group_communicator(group: Any):
    """The Sm120Communicator attached to `group`, or None (not a TP group, mode off, or not attached yet)."""
    return getattr(group, ATTR, None)


def set_group_communicator(group: Any, comm: Any) -> None:
    """Attach `comm` to `group`; None detaches."""
    setattr(group, ATTR, comm)
