"""Entry point of the `sglang.srt.plugins` group (declared in the project's packaging as
`sm120_allreduce = sglang_sm120.plugin:activate`).

SGLang >= 0.5.12 calls it in the launcher before parsing arguments (so the flags exist), in `sglang.Engine`,
and at the start of every scheduler process before the model and the process groups are built (so the
seams are in place where the work happens). Patching in the launcher alone would not reach the schedulers,
which are spawned, not forked.
"""

from __future__ import annotations

import logging
import threading

from . import seams
from .seams import base

logger = logging.getLogger("sglang_sm120")

_lock = threading.Lock()
_active_version: str | None = None


def activate() -> None:
    """Patch the installed SGLang. Idempotent. Raises UnsupportedSGLangVersion for versions without a table
    (SGLang logs a plugin's exception and carries on unpatched)."""
    global _active_version
    with _lock:
        if _active_version is not None:
            return
        version = seams.sglang_version()
        table = seams.load_table(version)
        count = base.apply(table.SEAMS)
        _active_version = version
        logger.info(
            "sglang_sm120: overlay active on sglang %s (%d seams patched, %d more when their modules are imported)",
            version, count, len(base.pending_targets()),
        )


def deactivate() -> None:
    """Restore every original attribute (used by tests)."""
    global _active_version
    with _lock:
        base.restore_all()
        _active_version = None


def is_active() -> bool:
    return _active_version is not None
