"""NCCL's settings, the transports its INFO log says it chose, and what to change when it is slow (pure Python).

The log formats are NCCL's own (src/transport/{p2p,shm,net,coll_net}.cc, src/init.cc): one line per channel
connection, "Channel CC[/I] : SRC[dev] -> DST[dev] [send|receive] via KIND/...", logged by the rank that set it
up. Why P2P may be refused: NCCL's default P2P level is PXB (no P2P through a CPU host bridge) on Intel and ARM
CPUs, and since 2.23 on AMD too with more than two GPUs (src/graph/paths.cc, ncclTopoCheckP2p)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

BASE = "as is"  # the variant that runs the environment unchanged
SPEEDUP = 1.5  # a change is advised when NCCL is at least this much faster at every verify size
INDIRECT = ("SHM", "NET", "COLLNET")  # transports that stage data in host memory or a NIC instead of GPU to GPU
# Channel lines are INIT|P2P, INIT|SHM, INIT|NET in 2.18-2.30; the version line is ALL.
LOG_SUBSYS = "INIT,P2P,SHM,NET"

_LINK = re.compile(r"NCCL INFO (?:Channel|CollNet) (\d+)(?:/\d+)? : (\d+)(?:\[\d+\])? (?:-> (\d+)\[\d+\] )?"
                   r"(?:\[(?:send|receive)\] )?via (\S.*?)\s*$")
_VERSION = re.compile(r"\bNCCL version (\S+)")


def settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every NCCL_* variable of the environment, sorted by name."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith("NCCL_")}


def parse_log(text: str) -> dict:
    """NCCL INFO log(s) of one or more ranks -> {"nccl_version", "pairs": {"SRC->DST": {"P2P/CUMEM/read": lines}}}
    (a CollNet line names no peer: "SRC->collnet"). One version: NCCL refuses ranks of different versions."""
    pairs: dict[tuple[int, int], dict[str, int]] = {}
    for m in filter(None, map(_LINK.search, text.splitlines())):
        via = pairs.setdefault((int(m.group(2)), int(m.group(3) or -1)), {})
        via[m.group(4)] = via.get(m.group(4), 0) + 1
    v = _VERSION.search(text)
    named = {f"{s}->{d if d >= 0 else 'collnet'}": pairs[s, d] for s, d in sorted(pairs)}
    return {"nccl_version": v.group(1) if v else None, "pairs": named}


def kind(via: str) -> str:
    """'P2P/CUMEM/read' -> 'P2P', 'SHM/direct/direct' -> 'SHM', 'NET/Socket/0' -> 'NET'."""
    return via.split("/", 1)[0]


def pairs_by_kind(pairs: Mapping[str, Mapping[str, int]]) -> dict[str, list[str]]:
    """{'SHM': ['0->1', ...], 'P2P': [...]}: which pairs NCCL connected through each kind."""
    out: dict[str, list[str]] = {}
    for pair, via in pairs.items():
        for k in sorted({kind(name) for name in via}):
            out.setdefault(k, []).append(pair)
    return out


def log_env(folder: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that send NCCL's INFO channel lines to one file per process in `folder`; none when the caller
    chose where NCCL logs (NCCL_DEBUG or NCCL_DEBUG_FILE set). Not part of a table key (facts.key_facts)."""
    if environ.get("NCCL_DEBUG") or environ.get("NCCL_DEBUG_FILE"):
        return {}
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": LOG_SUBSYS,
            "NCCL_DEBUG_FILE": os.path.join(folder, "nccl.%p.log")}


def transports_line(pairs: Mapping[str, Mapping[str, int]], version: str | None) -> str:
    """One line naming the kind NCCL connected each pair through, as it logged them ('' when it logged none)."""
    by_kind = pairs_by_kind(pairs)
    if not by_kind:
        return ""
    return f"NCCL {version or '?'} connected " + "; ".join(f"{k} for {' '.join(v)}" for k, v in sorted(by_kind.items()))


def _strtol(value: str) -> int | None:
    """The leading integer, as C's strtol reads it for NCCL (hex and octal spellings aside); None if none."""
    m = re.match(r"\s*([+-]?\d+)", value)
    return int(m.group(1)) if m else None


def p2p_disabled(environ: Mapping[str, str]) -> bool:
    """NCCL_P2P_DISABLE turns P2P off only when it reads as exactly 1 (src/graph/paths.cc, ncclGetLevel)."""
    return _strtol(environ.get("NCCL_P2P_DISABLE", "")) == 1


def p2p_level_is_sys(environ: Mapping[str, str]) -> bool:
    """NCCL_P2P_LEVEL lets P2P cross the CPU when it is 'SYS' (case-sensitive) or an old-style number >= 4."""
    value = environ.get("NCCL_P2P_LEVEL", "")
    return value == "SYS" or (value[:1].isdigit() and (_strtol(value) or 0) >= 4)


def variant_plan(environ: Mapping[str, str]) -> list[str]:
    """The variants worth timing besides BASE: P2P re-enabled when disabled, the P2P level raised to SYS when
    lower or unset (under NCCL_P2P_DISABLE=1 the level is ignored, so it is tried only together with the unset)."""
    unset = ["unset NCCL_P2P_DISABLE"] if p2p_disabled(environ) else []
    level = [] if p2p_level_is_sys(environ) else ["NCCL_P2P_LEVEL=SYS"]
    plans = [unset, [*unset, *level]] if level else [unset]
    return [", ".join(p) for p in plans if p]


def changes(variant: str) -> dict[str, str | None]:
    """'unset NCCL_P2P_DISABLE, NCCL_P2P_LEVEL=SYS' -> {'NCCL_P2P_DISABLE': None, 'NCCL_P2P_LEVEL': 'SYS'}."""
    tokens = [] if variant == BASE else variant.split(", ")
    return {t.removeprefix("unset ").partition("=")[0]: None if t.startswith("unset ") else t.partition("=")[2]
            for t in tokens}


def apply(variant: str, environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of environ with the variant's changes made."""
    todo = changes(variant)
    return {**{k: v for k, v in environ.items() if k not in todo}, **{k: v for k, v in todo.items() if v is not None}}


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
        return (f"{self.why}. Fix: `{'; '.join(self.commands)}` where `sglang serve` starts (its shell, container or "
                "service), so the launcher and every scheduler process inherit it (NCCL reads it once, at start)")


def advice(measurements: Mapping[str, Mapping[str, float]], transports: Mapping[str, Mapping[str, Mapping[str, int]]],
           p2p_works: bool | None) -> list[Advice]:
    """What to set, from NCCL's times (variant -> verify size -> us, BASE included), the transports it logged
    (variant -> pair -> transport -> lines) and whether CUDA P2P works between every pair (None: unknown)."""
    base = measurements.get(BASE) or {}
    ratios = {v: [base[s] / t[s] for s in base if t.get(s)] for v, t in measurements.items() if v != BASE}
    speed = {v: min(r) for v, r in ratios.items() if r}  # the smallest gain over the sizes both measured
    fast = {v: s for v, s in speed.items() if s >= SPEEDUP}
    indirect = {k: p for k, p in pairs_by_kind(transports.get(BASE, {})).items() if k in INDIRECT}
    detour = None
    if indirect and p2p_works:
        shown = "; ".join(f"{k} for {' '.join(p[:8])}{' ...' if len(p) > 8 else ''}" for k, p in indirect.items())
        detour = f"NCCL goes through {shown} although CUDA P2P is available between every pair of GPUs"
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
    return [Advice(None, f"{detour}, and no NCCL_P2P_* change gave a working P2P: check the doctor's IOMMU and ACS "
                         "lines, and NCCL_* lines in NCCL's nccl.conf files (the environment overrides them)")]
