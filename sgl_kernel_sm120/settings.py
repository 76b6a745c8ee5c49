"""Every switch of the kernel package, read once into a frozen `KernelSettings` (`read()`).

SGLang 0.5.23 copies every SGL_* variable to its SGLANG_* twin and tells the user to use that name, so a switch is
read under both spellings; one switch set to two different values is an error naming both, never a guess. A bad
value is a `SettingError` of one line: the variable, its value and what is allowed. Standard library only: the
overlay reads these before torch is imported.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

LEGACY_PREFIX, PREFIX = "SGL_", "SGLANG_"
# The probe-drop switch's parts (csrc/probe.cu): the writes only, the loads only, the writes into the slab's last
# page only (a mapping broken for part of a slab); none given: the writes and the loads.
PROBE_DROP_PARTS = ("write", "read", "last")
PROBE_DROP_MEMORIES = ("device", "host", "any")


class SettingError(ValueError):
    """A switch holds a value it does not take (or its two spellings disagree)."""


@dataclasses.dataclass(frozen=True)
class ProbeDrop:
    """The data-path probe's negative control (SGL_SM120_DEBUG_PROBE_DROP=SRC:DST[:write|:read|:last][@MEMORY]):
    rank `src` skips its probe writes to `dst` and corrupts its loads from it (`part` None), only skips the writes
    ("write"), only corrupts the loads ("read"), or skips only its writes into the last page of `dst`'s slab
    ("last"), in workspaces of `memory` ("device", "host" or "any")."""

    src: int
    dst: int
    part: str | None = None
    memory: str = "device"


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    timeout_s: float = 300.0  # a spin-wait past this ends in the timeout record (I7); minutes: a late peer is not dead
    warn_after_s: float = 5.0  # a wait past this is logged once per call (I9)
    abort_after_s: float = 30.0  # trap mode: abort a process whose trap has not arrived this long after (0: never)
    pdl: bool = True  # launch with programmatic dependent launch
    fused_clusters: bool = True  # check cluster launch on the box and use it; False: never launch clusters
    shm_dir: str = "/dev/shm"  # the tmpfs of the host-memory workspace's shared file
    library: str = ""  # load this kernel library instead of the packaged one (the negative-control builds)
    # the cluster-check verdicts and the routing tables
    cache_dir: str = dataclasses.field(default_factory=lambda: os.path.expanduser("~/.cache/sglang_sm120"))
    debug_cluster_check: str = ""  # "trap": the cluster check's child traps first (its negative control)
    debug_probe_drop: ProbeDrop | None = None
    debug_shm_no_precheck: bool = False  # skip the tmpfs size check, so the allocation meets a full tmpfs
    given: frozenset[str] = frozenset()  # the fields whose switch is set (the rest are defaults)


def spellings(name: str) -> tuple[str, ...]:
    """An SGL_ name and its SGLANG_ twin; any other name itself only (SGLang never copies SGLANG_ names back)."""
    return (name, PREFIX + name[len(LEGACY_PREFIX):]) if name.startswith(LEGACY_PREFIX) else (name,)


def spelled_out(name: str, value: str) -> dict[str, str]:
    """The switch at `value` under every spelling: what setting it for a child process must write."""
    return dict.fromkeys(spellings(name), value)


def _raw(name: str, env: Mapping[str, str]) -> tuple[str, str | None]:
    """(the spelling found, its value) or (name, None) when unset or empty."""
    found = {spelled: env[spelled] for spelled in spellings(name) if spelled in env}
    if len(set(found.values())) > 1:
        shown = " and ".join(f"{spelled}={value!r}" for spelled, value in found.items())
        raise SettingError(f"{shown} are one switch set to two values: unset one of them")
    spelled, value = next(iter(found.items()), (name, ""))
    return spelled, value.strip() or None


def _seconds(name: str, raw: str, zero: bool) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (0 <= value if zero else 0 < value) or not value < 1e9:  # also refuses nan and inf
        raise SettingError(f"{name}={raw!r}: a number of seconds " + (">= 0 (0: off)" if zero else "> 0"))
    return value


def _choice(name: str, raw: str, choices: dict[str, object]) -> object:
    key = raw.lower()
    if key not in choices:
        raise SettingError(f"{name}={raw!r}: one of {', '.join(choices)}")
    return choices[key]


def _probe_drop(name: str, raw: str) -> ProbeDrop:
    spec, _, memory = raw.partition("@")
    parts = spec.split(":")
    try:
        part = parts[2] if len(parts) == 3 else None
        if len(parts) not in (2, 3) or part not in (None, *PROBE_DROP_PARTS) or \
                (memory or "device") not in PROBE_DROP_MEMORIES:
            raise ValueError
        return ProbeDrop(int(parts[0]), int(parts[1]), part, memory or "device")
    except ValueError:
        raise SettingError(f"{name}={raw!r}: SRC:DST or SRC:DST:{'|'.join(PROBE_DROP_PARTS)} (SRC and DST rank "
                           "numbers), optionally followed by @device (the default), @host or @any") from None


_BOOL = {"1": True, "0": False}
_SWITCHES = {  # field: (variable, parser); an SGL_ variable is read under its SGLANG_ twin too
    "timeout_s": ("SGL_SM120_AR_TIMEOUT_S", lambda n, r: _seconds(n, r, False)),
    "warn_after_s": ("SGL_SM120_AR_WARN_S", lambda n, r: _seconds(n, r, False)),
    "abort_after_s": ("SGL_SM120_AR_ABORT_AFTER_S", lambda n, r: _seconds(n, r, True)),
    "pdl": ("SGL_SM120_AR_PDL", lambda n, r: _choice(n, r, _BOOL)),
    "fused_clusters": ("SGL_SM120_FUSED_CLUSTERS", lambda n, r: _choice(n, r, {"auto": True, "off": False})),
    "shm_dir": ("SGL_SM120_SHM_DIR", lambda n, r: r),
    "library": ("SGL_SM120_EXT_LIBRARY", lambda n, r: r),
    "cache_dir": ("SGLANG_SM120_CACHE", lambda n, r: os.path.expanduser(r)),
    "debug_cluster_check": ("SGL_SM120_DEBUG_CLUSTER_CHECK", lambda n, r: _choice(n, r, {"trap": "trap"})),
    "debug_probe_drop": ("SGL_SM120_DEBUG_PROBE_DROP", _probe_drop),
    "debug_shm_no_precheck": ("SGL_SM120_DEBUG_SHM_NO_PRECHECK", lambda n, r: _choice(n, r, _BOOL)),
}
VARIABLES = {field: variable for field, (variable, _) in _SWITCHES.items()}


def read(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """Every switch from `environ` (default os.environ); SettingError on the first bad one."""
    env = os.environ if environ is None else environ
    values = {}
    for field, (name, parse) in _SWITCHES.items():
        spelled, raw = _raw(name, env)
        if raw is not None:
            values[field] = parse(spelled, raw)
    return KernelSettings(**values, given=frozenset(values))


def launch_switches(settings: KernelSettings) -> dict[str, str]:
    """The switches that change how a workspace launches its kernels, as the variables would spell them (the
    routing table's key: a route measured under other switches ran another launch)."""
    return {VARIABLES["pdl"]: "1" if settings.pdl else "0",
            VARIABLES["fused_clusters"]: "auto" if settings.fused_clusters else "off"}
