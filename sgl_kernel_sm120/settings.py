"""Every switch of the kernel package, read once into a frozen `KernelSettings` (`read()`); and the one reader of a
setting's two spellings (`lookup`) and the one family of parsers, which the overlay's settings use too.

A setting has two spellings, SGL_SM120_X and SGLANG_SM120_X: SGLang (0.5.13.post1 and 0.5.23) copies every SGL_*
variable over its SGLANG_* twin when it is imported, and tells the user to use that name. One setting at two
different values is an error naming both, never a guess, also after that copy made them equal (`lookup`). A bad
value is a `SettingError` of one line, `NAME='value': what is allowed`. Standard library only: the overlay reads
these before torch is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence

LEGACY_PREFIX, PREFIX = "SGL_", "SGLANG_"
# The probe-drop switch's parts (csrc/probe.cu): the writes only, the loads only, the writes into the slab's last
# page only (a mapping broken for part of a slab); none given: the writes and the loads.
PROBE_DROP_PARTS = ("write", "read", "last")
PROBE_DROP_MEMORIES = ("device", "host", "any")
MAX_SECONDS = 1e9  # a wait bound past it is a typo (and the kernels count waits in 64-bit nanoseconds)


class SettingError(ValueError):
    """A setting holds a value it does not take (or its two spellings disagree)."""


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


def spellings(name: str) -> tuple[str, str]:
    """The setting's two names: SGL_SM120_X and SGLANG_SM120_X."""
    stem = name.removeprefix(PREFIX).removeprefix(LEGACY_PREFIX)
    return LEGACY_PREFIX + stem, PREFIX + stem


@functools.cache
def _started_with() -> dict[str, str]:
    """The environment this process was started with (Linux keeps it apart: changes to os.environ do not reach
    /proc/self/environ); empty where it cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        return {}
    return {os.fsdecode(key): os.fsdecode(value) for key, _, value in (e.partition(b"=") for e in entries if e)}


def lookup(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(the spelling set, its value without surrounding blanks), or None when neither is set (empty is unset).

    Both set to different values is a SettingError naming both. In this process's own environment (`environ`
    None) two equal values may be SGLang's copy of SGL_X over an SGLANG_X the user set otherwise, done before any
    code of ours runs: where SGL_X still holds what the process was started with and SGLANG_X held something else
    then, that is what the user set, and the error names it."""
    env = os.environ if environ is None else environ
    legacy, current = spellings(name)
    found = {spelled: env[spelled].strip() for spelled in (legacy, current) if env.get(spelled, "").strip()}
    if environ is None and len(found) == 2 and found[legacy] == found[current]:
        started = {spelled: _started_with().get(spelled, "").strip() for spelled in (legacy, current)}
        if started[legacy] == found[legacy] and started[current] not in ("", found[current]):
            found[current] = started[current]
    if len(set(found.values())) > 1:
        shown = " and ".join(f"{spelled}={value!r}" for spelled, value in found.items())
        raise SettingError(f"{shown} are one setting at two values: unset one of them")
    return next(iter(found.items()), None)


# The parsers: each takes (the name the value came under, the value) and returns the setting or raises refuse().
Parser = Callable[[str, object], object]


def refuse(name: str, raw: object, allowed: str) -> SettingError:
    return SettingError(f"{name}={raw!r}: {allowed}")


def choice(choices: Mapping[str, object] | Sequence[str], meaning: str = "") -> Parser:
    """One of `choices` (a word, any case; a mapping gives each word's value)."""
    table = dict(choices) if isinstance(choices, Mapping) else {word: word for word in choices}
    allowed = f"one of {', '.join(table)}" + (f" ({meaning})" if meaning else "")

    def parse(name: str, raw: object) -> object:
        key = str(raw).strip().lower()
        if key not in table:
            raise refuse(name, raw, allowed)
        return table[key]

    return parse


def seconds(*, zero: bool = False, most: float = MAX_SECONDS) -> Parser:
    """A number of seconds above 0 (`zero`: 0 too, meaning off), at most `most`."""
    allowed = f"a number of seconds {'>= 0 (0: off)' if zero else '> 0'}, at most {most:g}"

    def parse(name: str, raw: object) -> float:
        try:
            value = float(str(raw))
        except ValueError:
            value = math.nan
        if not (0 <= value if zero else 0 < value) or not value <= most:  # also refuses nan
            raise refuse(name, raw, allowed)
        return value

    return parse


def count(low: int, high: int | None = None, *, what: str = "an integer", also: str = "") -> Parser:
    """An integer from `low` to `high` (decimal, or 0x hexadecimal); `what` names it, `also` the other words the
    caller takes."""
    allowed = f"{what} from {low} to {high}" if high is not None else f"{what} >= {low}"
    allowed += f", {also}" if also else ""

    def parse(name: str, raw: object) -> int:
        try:
            number = raw if isinstance(raw, int) and not isinstance(raw, bool) else int(str(raw).strip(), 0)
        except ValueError:
            number = None
        if isinstance(raw, bool) or number is None or number < low or (high is not None and number > high):
            raise refuse(name, raw, allowed)
        return number

    return parse


def folder(*, create: bool = False) -> Parser:
    """A folder this user can write (a leading ~ is the home folder); `create`: or one that does not exist yet
    under a folder this user can write (the caller makes it when it first writes)."""
    allowed = "an existing folder this user can write" + (", or a new one inside such a folder" if create else "")

    def parse(name: str, raw: object) -> str:
        path = os.path.abspath(os.path.expanduser(str(raw).strip()))
        nearest = path
        while create and not os.path.lexists(nearest):
            nearest = os.path.dirname(nearest)
        if not (os.path.isdir(nearest) and os.access(nearest, os.W_OK | os.X_OK)):
            raise refuse(name, raw, allowed)
        return path

    return parse


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
        raise refuse(name, raw, f"SRC:DST or SRC:DST:{'|'.join(PROBE_DROP_PARTS)} (SRC and DST rank numbers), "
                                "optionally followed by @device (the default), @host or @any") from None


_BOOL = choice({"1": True, "0": False})
_SWITCHES: dict[str, tuple[str, Parser]] = {  # field: (variable, parser); read under both spellings
    "timeout_s": ("SGL_SM120_AR_TIMEOUT_S", seconds()),
    "warn_after_s": ("SGL_SM120_AR_WARN_S", seconds()),
    "abort_after_s": ("SGL_SM120_AR_ABORT_AFTER_S", seconds(zero=True)),
    "pdl": ("SGL_SM120_AR_PDL", _BOOL),
    "fused_clusters": ("SGL_SM120_FUSED_CLUSTERS", choice({"auto": True, "off": False})),
    "shm_dir": ("SGL_SM120_SHM_DIR", folder()),
    "library": ("SGL_SM120_EXT_LIBRARY", lambda name, raw: raw),
    "cache_dir": ("SGLANG_SM120_CACHE", folder(create=True)),
    "debug_cluster_check": ("SGL_SM120_DEBUG_CLUSTER_CHECK", choice(("trap",))),
    "debug_probe_drop": ("SGL_SM120_DEBUG_PROBE_DROP", _probe_drop),
    "debug_shm_no_precheck": ("SGL_SM120_DEBUG_SHM_NO_PRECHECK", _BOOL),
}
VARIABLES = {field: variable for field, (variable, _) in _SWITCHES.items()}


def read(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """Every switch from `environ` (default os.environ); SettingError on the first bad one."""
    values = {field: parse(*found) for field, (name, parse) in _SWITCHES.items()
              if (found := lookup(name, environ)) is not None}
    return KernelSettings(**values, given=frozenset(values))


def launch_switches(settings: KernelSettings) -> dict[str, str]:
    """The switches that change how a workspace launches its kernels, as the variables would spell them (the
    routing table's key: a route measured under other switches ran another launch)."""
    return {VARIABLES["pdl"]: "1" if settings.pdl else "0",
            VARIABLES["fused_clusters"]: "auto" if settings.fused_clusters else "off"}
