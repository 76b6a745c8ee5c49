"""The kernel package's environment switches, read under both prefixes.

SGLang 0.5.23 treats every variable named SGL_* as a deprecated spelling of SGLANG_*: when it imports, it copies
the value to the SGLANG_ name and warns "please use SGLANG_...". A switch of this package (SGL_SM120_AR_TIMEOUT_S,
say) must therefore keep working under the name that warning recommends, or a user who follows it would be
ignored without a word. Every switch is read here under both spellings; one switch set to two different values
is an error naming both, never a guess.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LEGACY_PREFIX = "SGL_"
PREFIX = "SGLANG_"


def spellings(name: str) -> tuple[str, ...]:
    """The names a switch is read under: an SGL_ name and its SGLANG_ twin; any other name, itself only (SGLang
    never copies SGLANG_ names back)."""
    if name.startswith(LEGACY_PREFIX):
        return name, PREFIX + name[len(LEGACY_PREFIX):]
    return (name,)


def spelled_out(name: str, value: str) -> dict[str, str]:
    """The switch set to `value` under every spelling: what a caller that sets a switch for a child process (or
    for this one) must write, since the environment it copies may already hold the twin with another value."""
    return dict.fromkeys(spellings(name), value)


def setting(name: str, default: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The switch's value under either spelling, or `default` when neither is set; ValueError when both are set
    to different values."""
    env = os.environ if environ is None else environ
    found = {spelled: env[spelled] for spelled in spellings(name) if spelled in env}
    if len(set(found.values())) > 1:
        shown = " and ".join(f"{spelled}={value!r}" for spelled, value in found.items())
        raise ValueError(f"{shown} are one switch set to two values: unset one of them")
    return next(iter(found.values()), default)
