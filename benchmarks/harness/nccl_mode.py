"""NCCL's P2P mode: which NCCL a run measures.

NCCL reads NCCL_P2P_DISABLE (like its other parameters) once per process, when its first communicator is
created, and init_distributed creates one right away. A run therefore measures exactly one NCCL, and each
has its own name in the results: `nccl` (P2P allowed: the default mode) or `nccl_no_p2p` (--no-p2p: the
benchmark sets NCCL_P2P_DISABLE=1 before init_distributed, so NCCL moves data through its shared-memory
transport, staged in host memory). A name that does not fit the mode is refused before NCCL starts.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from sglang_sm120.core import nccl as nccl_log

from .hardware import recordable

NO_P2P_TAG = "nop2p"
NCCL_PLAIN = "nccl"
NCCL_NO_P2P = "nccl_no_p2p"


def nccl_label_error(names: Iterable[str], no_p2p: bool) -> str | None:
    """Why these implementation/backend names cannot be measured in this mode, or None."""
    names = list(names)
    if no_p2p and NCCL_PLAIN in names:
        return (f"--no-p2p runs NCCL with NCCL_P2P_DISABLE=1, which is not the NCCL that `{NCCL_PLAIN}` names: "
                f"ask for `{NCCL_NO_P2P}` instead (or drop --no-p2p to measure NCCL with P2P)")
    if not no_p2p and NCCL_NO_P2P in names:
        return (f"`{NCCL_NO_P2P}` needs --no-p2p: NCCL reads NCCL_P2P_DISABLE once per process, when its first "
                "communicator is created, and only that mode sets it before NCCL starts")
    return None


def _nccl_int_on(value: str | None) -> bool:
    """NCCL reads its switches as integers; any nonzero value is on, anything unparsable reads as 0."""
    if value is None:
        return False
    try:
        return int(value.strip(), 0) != 0
    except ValueError:
        return False


def p2p_disabling_env(environ: Mapping[str, str]) -> list[str]:
    """The settings in ``environ`` that turn NCCL's P2P transport off, as 'NAME=value'."""
    out = []
    if _nccl_int_on(environ.get("NCCL_P2P_DISABLE")):
        out.append(f"NCCL_P2P_DISABLE={environ['NCCL_P2P_DISABLE']}")
    level = environ.get("NCCL_P2P_LEVEL", "").strip().upper()
    if level in ("LOC", "0"):
        out.append(f"NCCL_P2P_LEVEL={environ['NCCL_P2P_LEVEL']}")
    return out


def nccl_env(environ: Mapping[str, str] | None = None) -> dict:
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith("NCCL_") and recordable(k)}


def _nccl_started() -> bool:
    tdist = sys.modules.get("torch.distributed")
    try:
        return bool(tdist is not None and tdist.is_available() and tdist.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def prepare_nccl_mode(no_p2p: bool, uses_nccl_label: bool, environ: dict | None = None, *,
                      nccl_started: bool | None = None) -> dict:
    """Set up (``no_p2p``) or check (default mode) NCCL's P2P settings; call BEFORE init_distributed.

    uses_nccl_label: the run records a result under an NCCL name (`nccl`, `nccl_no_p2p`, SGLang's NCCL).
    Raises ValueError when the environment would make a label wrong. Returns the record for the JSON
    (``mode``, ``env_at_init``: the NCCL_* variables NCCL starts with, ``set_by_benchmark``, ``env_before``);
    ``_debug_file`` (not for the JSON) is where NCCL's INFO log goes when the benchmark asked for it.
    """
    env = os.environ if environ is None else environ
    started = _nccl_started() if nccl_started is None else nccl_started
    if not no_p2p:
        bad = p2p_disabling_env(env)
        if bad and uses_nccl_label:
            raise ValueError(f"{', '.join(bad)} is set, so NCCL would run without P2P while its results are "
                             f"recorded as `{NCCL_PLAIN}`: unset it, or run with --no-p2p (`{NCCL_NO_P2P}`)")
        mode = {"mode": "default", "no_p2p": False, "set_by_benchmark": {}, "p2p_disabled_by": bad}
        if uses_nccl_label and not started:  # which transports the NCCL measured here chose
            wanted, mode["_debug_file"], mode["transport_log"] = _info_log(env)
            env.update(wanted)
            mode["set_by_benchmark"] = dict(wanted)
        return {**mode, "env_at_init": nccl_env(env)}
    if started:
        raise ValueError("--no-p2p must set NCCL_P2P_DISABLE=1 before NCCL starts, but torch.distributed is "
                         "already initialised in this process (NCCL may have read its settings already)")
    if _nccl_int_on(env.get("NCCL_SHM_DISABLE")):
        raise ValueError(f"--no-p2p measures NCCL's shared-memory transport, but NCCL_SHM_DISABLE="
                         f"{env['NCCL_SHM_DISABLE']} is set (NCCL would use its network transport): unset it")
    if _nccl_int_on(env.get("NCCL_NVLS_ENABLE")):
        raise ValueError(f"--no-p2p measures NCCL through host memory, but NCCL_NVLS_ENABLE="
                         f"{env['NCCL_NVLS_ENABLE']} lets NCCL use NVLink SHARP: unset it or set it to 0")
    wanted = {"NCCL_P2P_DISABLE": "1"}
    if env.get("NCCL_NVLS_ENABLE") is None:
        wanted["NCCL_NVLS_ENABLE"] = "0"
    log_vars, debug_file, log_note = _info_log(env)
    wanted.update(log_vars)
    before = {k: env.get(k) for k in wanted}
    env.update(wanted)
    return {
        "mode": "no_p2p",
        "no_p2p": True,
        "how": "--no-p2p: NCCL_P2P_DISABLE=1 set by the benchmark before the first NCCL communicator",
        "set_by_benchmark": dict(wanted),
        "env_before": before,
        "env_at_init": nccl_env(env),
        "transport_log": log_note,
        "_debug_file": debug_file,
    }


def _info_log(env: Mapping[str, str]) -> tuple[dict, str | None, str]:
    """(the variables that send NCCL's INFO log to a per-process file, the file, a note for the JSON); nothing when
    the caller set NCCL_DEBUG or NCCL_DEBUG_FILE."""
    if env.get("NCCL_DEBUG") is not None or env.get("NCCL_DEBUG_FILE") is not None:
        return {}, None, "not collected: NCCL_DEBUG or NCCL_DEBUG_FILE was set by the caller"
    import tempfile

    debug_file = os.path.join(tempfile.mkdtemp(prefix="bench-nccl-log-"), "nccl.%p.log")
    return ({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": debug_file}, debug_file,
            "NCCL_DEBUG=INFO into a per-process file, parsed for its 'via <transport>' channel lines (the file itself "
            "is not kept: its lines name the host)")


def enter_nccl_mode(script: str, no_p2p: bool, uses_nccl_label: bool) -> dict:
    """prepare_nccl_mode for a script's main(): a refusal exits 2 with one line, before any number."""
    try:
        return prepare_nccl_mode(no_p2p, uses_nccl_label)
    except ValueError as e:
        print(f"{script}: {e}. No numbers were produced.", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def parse_nccl_log(text: str) -> dict:
    """NCCL INFO log -> {"transports": {"SHM": n, "P2P": m, ...} (channel connections), "nccl_version"}, read with
    the overlay's parser of NCCL's lines (sglang_sm120/core/nccl.py)."""
    log = nccl_log.parse_log(text)
    counts: dict[str, int] = {}
    for name, n in ((name, n) for via in log["pairs"].values() for name, n in via.items()):
        counts[nccl_log.kind(name)] = counts.get(nccl_log.kind(name), 0) + n
    return {"transports": counts, "nccl_version": log["nccl_version"]}


def read_nccl_log(debug_file: str | None) -> dict | None:
    """This process's NCCL log (NCCL_DEBUG_FILE with %p = this pid), parsed; None when none was asked for."""
    if not debug_file:
        return None
    path = Path(debug_file.replace("%p", str(os.getpid())))
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {"found": False, "transports": {}, "nccl_version": None}
    return {"found": True, **parse_nccl_log(text)}


def merge_nccl_logs(per_rank: Sequence[dict | None]) -> dict:
    """Every rank's parsed log -> the transports NCCL logged over all ranks and a verdict on P2P."""
    logs = [x for x in per_rank if x]
    total: dict[str, int] = {}
    for x in logs:
        for k, n in x.get("transports", {}).items():
            total[k] = total.get(k, 0) + n
    versions = sorted({x["nccl_version"] for x in logs if x.get("nccl_version")})
    if not logs:
        verdict = "not collected"
    elif not any(x.get("found") for x in logs):
        verdict = "no NCCL log file was written"
    elif "P2P" in total:
        verdict = "P2P channels logged"
    elif total:
        verdict = "no P2P channel logged"
    else:
        verdict = "no channel lines logged"
    return {"ranks_with_log": sum(1 for x in logs if x.get("found")), "transports_seen": total,
            "nccl_version_logged": versions[0] if len(versions) == 1 else (versions or None),
            "p2p_seen": ("P2P" in total) if total else None, "verdict": verdict}


def collect_nccl_transports(d, mode: dict) -> None:
    """Collective (every rank calls it at the same point): gather what NCCL logged into ``mode``."""
    local = None
    with contextlib.suppress(Exception):
        local = read_nccl_log(mode.get("_debug_file"))
    merged = merge_nccl_logs(d.all_gather_obj(local))
    if mode.get("_debug_file"):
        mode["transports"] = merged
        if merged["p2p_seen"] and mode.get("no_p2p"):
            d.log(f"WARNING: --no-p2p run, but NCCL logged P2P channels: {merged['transports_seen']}")


def cleanup_nccl_log(mode: dict | None) -> None:
    f = (mode or {}).get("_debug_file")
    if not f:
        return
    with contextlib.suppress(Exception):
        Path(f.replace("%p", str(os.getpid()))).unlink(missing_ok=True)
        Path(f).parent.rmdir()  # each process made its own folder (prepare_nccl_mode)


def nccl_setup_line(setup: Mapping) -> str:
    """One line for the tables: the NCCL a run measured (its settings, the channels it logged)."""
    env = {k: v for k, v in (setup.get("env_at_init") or {}).items() if not k.startswith("NCCL_DEBUG")}
    tr = setup.get("transports") or {}
    return (f"NCCL {setup.get('nccl_version')} with {env or 'no NCCL_* settings'} at init; "
            f"channels NCCL logged: {tr.get('transports_seen', {})} ({tr.get('verdict', 'not collected')})")


def public_nccl_mode(mode: dict | None) -> dict | None:
    """The record without its private keys (the local log path)."""
    return None if mode is None else {k: v for k, v in mode.items() if not k.startswith("_")}


def output_tag(no_p2p: bool) -> str:
    return NO_P2P_TAG if no_p2p else ""
