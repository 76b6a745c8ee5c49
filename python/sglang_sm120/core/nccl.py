"""NCCL's settings, the transports its INFO log says it chose, and what to change when it is slow (pure Python).

The log formats are NCCL's own (src/transport/{p2p,shm,net,coll_net}.cc, src/init.cc): one line per channel
connection, "Channel CC[/I] : SRC[dev] -> DST[dev] [send|receive] via KIND/...", logged by the rank that set it
up; NCCL >= 2.23 no longer lets P2P cross a CPU host bridge by default (src/graph/paths.cc: PXB, SYS before)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Mapping

BASE = "as is"  # the variant that runs the environment unchanged
SPEEDUP = 1.5  # a change is advised when NCCL is at least this much faster at every verify size
INDIRECT = ("SHM", "NET", "COLLNET")  # transports that stage data in host memory or a NIC instead of GPU to GPU

_LINK = re.compile(r"NCCL INFO (?:Channel|CollNet) (\d+)(?:/\d+)? : (\d+)(?:\[\d+\])? (?:-> (\d+)\[\d+\] )?"
                   r"(?:\[(?:send|receive)\] )?via (\S.*?)\s*$")
_VERSION = re.compile(r"\bNCCL version (\S+)")


def settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every NCCL_* variable of the environment, sorted by name."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith("NCCL_")}


def parse_log(text: str) -> dict:
    """One rank's NCCL INFO log -> {"nccl_version", "pairs": {"SRC->DST": {"P2P/CUMEM/read": lines, ...}}}.
    A CollNet line names no peer: its pair is "SRC->collnet"."""
    pairs: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        m = _LINK.search(line)
        if m:
            via = pairs.setdefault(f"{m.group(2)}->{m.group(3) or 'collnet'}", {})
            via[m.group(4)] = via.get(m.group(4), 0) + 1
    v = _VERSION.search(text)
    return {"nccl_version": v.group(1) if v else None, "pairs": pairs}


def merge_logs(logs: Iterable[dict | None]) -> dict:
    """Every rank's parse_log -> one: lines summed per pair and transport; the version(s) logged."""
    pairs: dict[str, dict[str, int]] = {}
    versions = set()
    for log in filter(None, logs):
        versions.update([log["nccl_version"]] if log.get("nccl_version") else [])
        for pair, via in log.get("pairs", {}).items():
            into = pairs.setdefault(pair, {})
            for name, n in via.items():
                into[name] = into.get(name, 0) + n
    version = sorted(versions)[0] if len(versions) == 1 else (sorted(versions) or None)
    return {"nccl_version": version, "pairs": {p: pairs[p] for p in sorted(pairs)}}


def kind(via: str) -> str:
    """'P2P/CUMEM/read' -> 'P2P', 'SHM/direct/direct' -> 'SHM', 'NET/Socket/0' -> 'NET'."""
    return via.split("/", 1)[0]


def kinds(pairs: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Lines per transport kind over all pairs."""
    out: dict[str, int] = {}
    for via in pairs.values():
        for name, n in via.items():
            out[kind(name)] = out.get(kind(name), 0) + n
    return out


def pairs_by_kind(pairs: Mapping[str, Mapping[str, int]]) -> dict[str, list[str]]:
    """{'SHM': ['0->1', ...], 'P2P': [...]}: which pairs NCCL connected through each kind."""
    out: dict[str, list[str]] = {}
    for pair, via in pairs.items():
        for k in sorted({kind(name) for name in via}):
            out.setdefault(k, []).append(pair)
    return out


def _strtol(value: str) -> int | None:
    """The number at the start of value as C's strtol(value, NULL, 0) reads it (NCCL's way); None if none."""
    m = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", value)
    if not m:
        return None
    body = m.group(2)
    n = int(body, 16) if body[:2].lower() == "0x" else int(body, 8) if body.startswith("0") else int(body)
    return -n if m.group(1) == "-" else n


def p2p_disabled(environ: Mapping[str, str]) -> bool:
    """NCCL_P2P_DISABLE turns P2P off only when it reads as exactly 1 (src/graph/paths.cc, ncclGetLevel)."""
    value = environ.get("NCCL_P2P_DISABLE")
    return value is not None and _strtol(value) == 1


def p2p_level_is_sys(environ: Mapping[str, str]) -> bool:
    """NCCL_P2P_LEVEL lets P2P cross the CPU when it is 'SYS' (case-sensitive) or an old-style number >= 4."""
    value = environ.get("NCCL_P2P_LEVEL")
    if value is None:
        return False
    n = _strtol(value) if value[:1].isdigit() else None
    return value == "SYS" or (n is not None and n >= 4)


def variant_plan(environ: Mapping[str, str] | None = None) -> list[str]:
    """The variants worth timing besides BASE: P2P re-enabled when disabled, the P2P level raised to SYS when
    lower or unset (under NCCL_P2P_DISABLE=1 the level is ignored, so it is tried only together with the unset)."""
    env = os.environ if environ is None else environ
    level = [] if p2p_level_is_sys(env) else ["NCCL_P2P_LEVEL=SYS"]
    if p2p_disabled(env):
        plans = [["unset NCCL_P2P_DISABLE"]] + ([["unset NCCL_P2P_DISABLE", *level]] if level else [])
    else:
        plans = [level] if level else []
    return [", ".join(p) for p in plans]


def changes(variant: str) -> dict[str, str | None]:
    """'unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL=SYS' -> {'NCCL_P2P_DISABLE': None, 'NCCL_P2P_LEVEL': 'SYS'}."""
    if variant == BASE:
        return {}
    out: dict[str, str | None] = {}
    for token in variant.split(", "):
        name, _, value = token.removeprefix("unset ").partition("=")
        out[name] = None if token.startswith("unset ") else value
    return out


def apply(variant: str, environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of environ with the variant's changes made."""
    env = dict(environ)
    for name, value in changes(variant).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@dataclasses.dataclass(frozen=True)
class Advice:
    variant: str | None  # the variant to adopt (None: nothing to set, only a cause to look into)
    why: str

    @property
    def commands(self) -> list[str]:
        return [f"unset {k}" if v is None else f"export {k}={v}" for k, v in changes(self.variant or BASE).items()]

    @property
    def line(self) -> str:
        if not self.commands:
            return self.why
        return (f"{self.why}. Fix: `{'; '.join(self.commands)}` in the shell that starts `sglang serve`, so the "
                "launcher and every scheduler process it spawns inherit it (NCCL reads it once, at start)")


def _speedup(base: Mapping[str, float], other: Mapping[str, float]) -> float | None:
    """The smallest base/other ratio over the sizes both measured (None when they share none)."""
    ratios = [base[s] / other[s] for s in base if s in other and other[s] > 0]
    return min(ratios) if ratios else None


def advice(measurements: Mapping[str, Mapping[str, float]], transports: Mapping[str, Mapping[str, Mapping[str, int]]],
           p2p_works: bool | None) -> list[Advice]:
    """What to set, from NCCL's times (variant -> verify size -> us, BASE included), the transports it logged
    (variant -> pair -> transport -> lines) and whether CUDA P2P works between every pair (None: unknown)."""
    base = measurements.get(BASE)
    speed = {v: _speedup(base, t) for v, t in measurements.items() if v != BASE and base} if base else {}
    fast = {v: s for v, s in speed.items() if s is not None and s >= SPEEDUP}
    indirect = {k: p for k, p in pairs_by_kind(transports.get(BASE, {})).items() if k in INDIRECT}
    detour = None
    if indirect and p2p_works:
        shown = "; ".join(f"{k} for {' '.join(p[:8])}{' ...' if len(p) > 8 else ''}" for k, p in indirect.items())
        detour = f"NCCL goes through {shown} although CUDA P2P works between every pair of GPUs"
    if fast:
        best = max(fast, key=fast.get)
        why = f"NCCL is at least {fast[best]:.1f}x faster at every verify size with {best}"
        return [Advice(best, f"{detour}; {why}" if detour else why)]
    if not detour:
        return []
    direct = [v for v, t in transports.items() if v != BASE and t and not set(pairs_by_kind(t)) & set(INDIRECT)]
    if direct:
        ratio = f" (measured {speed[direct[0]]:.1f}x here)" if speed.get(direct[0]) else ""
        return [Advice(direct[0], f"{detour}; with {direct[0]} every pair goes through P2P{ratio}")]
    return [Advice(None, f"{detour}, and no NCCL_P2P_* change moved it to P2P: check the doctor's IOMMU and ACS "
                         "lines, and NCCL_* lines in NCCL's nccl.conf files (the environment overrides them)")]
