"""Entry point of the `sglang.srt.plugins` group (declared in the project's packaging as
`sm120_allreduce = sglang_sm120.plugin:activate`).

SGLang >= 0.5.12 calls it in the launcher before parsing arguments (so the flags exist), in `sglang.Engine`,
and at the start of every scheduler process before the model and the process groups are built (so the
seams are in place where the work happens). Patching in the launcher alone would not reach the schedulers,
which are spawned, not forked.
"""

from __future__ import annotations

import logging
import sys
import threading

from . import seams
from .seams import base

logger = logging.getLogger("sglang_sm120")

FLAG_PREFIX = "--sm120-allreduce"  # every flag of ours (core/config.py) starts so

_lock = threading.Lock()
_active_version: str | None = None


def activate() -> None:
    """Patch the installed SGLang. Idempotent. Raises UnsupportedSGLangVersion for versions without a table
    and UnresolvedSeamTarget for a table whose targets this SGLang lacks (SGLang logs a plugin's exception and
    carries on unpatched), or, when the command line names one of our flags, ends the launch with one line
    instead (`refuse_our_flags`)."""
    global _active_version
    with _lock:
        if _active_version is not None:
            return
        version = seams.sglang_version()
        try:
            table = seams.load_table(version)
            count = base.apply(table.SEAMS)
        except (seams.UnsupportedSGLangVersion, base.UnresolvedSeamTarget) as exc:
            refuse_our_flags(exc)
            raise
        _active_version = version
        logger.info(
            "sglang_sm120: overlay active on sglang %s (%d seams patched, %d more when their modules are imported)",
            version, count, len(base.pending_targets()),
        )


def refuse_our_flags(exc: Exception, argv: list[str] | None = None) -> None:
    """The overlay cannot activate, so SGLang's parser will not know our flags. If the command line names one,
    end the launch now with one line that says why, instead of the `unrecognized arguments` SGLang's parser
    would print next (SGLang logs and swallows a plugin's exception, so it would come to that)."""
    argv = sys.argv if argv is None else argv
    flags = sorted({arg.split("=", 1)[0] for arg in argv[1:] if arg.startswith(FLAG_PREFIX)})
    if not flags:
        return
    why = str(exc).removeprefix("sglang_sm120: ").rstrip(".")
    them = "it" if len(flags) == 1 else "them"
    print(f"error: sglang_sm120: {why}. The command line names {', '.join(flags)}, which only the overlay adds to "
          f"SGLang's parser: drop {them} to run this SGLang without the overlay.", file=sys.stderr, flush=True)
    raise SystemExit(2)


def deactivate() -> None:
    """Restore every original attribute (used by tests)."""
    global _active_version
    with _lock:
        base.restore_all()
        _active_version = None


def is_active() -> bool:
    return _active_version is not None
