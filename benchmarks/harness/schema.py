"""The result documents of the benchmarks (benchmarks/results/*.json): validators, and the builders they share
(crossover, targets and their verdicts, the end-to-end estimate). No torch."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

ALLREDUCE_RESULT_KEYS = ("impl", "op", "rows", "hidden", "dtype", "bytes", "world_size", "median_us")
VERIFY_RESULT_KEYS = ("backend", "compute", "tokens", "step_us", "comm_us")
HARDWARE_KEYS = ("gpu", "driver", "cuda", "torch", "nccl", "world_size")
OPS = ("allreduce", "allreduce_add_rmsnorm")


class SchemaError(ValueError):
    pass


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise SchemaError(msg)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_hardware(hw: Mapping) -> None:
    _require(isinstance(hw, Mapping), "hardware must be an object")
    for k in HARDWARE_KEYS:
        _require(k in hw, f"hardware.{k} missing")
    _require("hostname" not in hw and "host" not in hw, "hardware must not carry a hostname")


def _validate_skipped(doc: Mapping) -> None:
    _require(isinstance(doc.get("skipped"), list), "skipped must be a list")
    for s in doc["skipped"]:
        _require(isinstance(s, Mapping) and "impl" in s and "reason" in s, f"bad skipped entry {s!r}")
        _require(isinstance(s["reason"], str) and s["reason"], "skipped.reason must be a non-empty string")


def crossover_bytes(ours: Mapping[int, float | None], nccl: Mapping[int, float | None]) -> int | None:
    """Largest size S (of the sizes both measured, ascending) such that ours <= NCCL at S and every smaller
    size. None when ours already loses (or is missing) at the smallest common size."""
    common = sorted(s for s in ours if s in nccl and nccl[s] is not None)
    best = None
    for s in common:
        o = ours.get(s)
        if o is None or o > nccl[s]:
            break
        best = s
    return best


# Targets a run is judged by, each a speed-up of ours over a peer at one [rows, hidden] shape and op, computed
# from the measured medians (evaluate_targets) and stored in the JSON under "targets"; never set by hand: the
# validator recomputes every verdict from the times next to it and the result entries they came from.
# The host-memory target (the --no-p2p run, 2x H200 with NCCL_P2P_DISABLE=1): at [3, 7168] bf16, ours through host
# memory >= 3x faster than NCCL's shared-memory transport, plain all-reduce, and fused against NCCL + the
# Triton add+RMSNorm (benchmarks/harness/triton_add_rmsnorm.py).
NO_P2P_TARGETS = (
    {"name": "allreduce_3x7168_vs_nccl_no_p2p", "op": "allreduce", "rows": 3, "hidden": 7168,
     "ours": "sm120_hostmem", "peer": "nccl_no_p2p", "min_speedup": 3.0,
     "text": "ours through host memory, all_reduce of [3, 7168] bf16: >= 3x faster than NCCL with P2P disabled"},
    {"name": "fused_3x7168_vs_nccl_no_p2p_norm", "op": "allreduce_add_rmsnorm", "rows": 3, "hidden": 7168,
     "ours": "sm120_hostmem", "peer": "nccl_no_p2p+add_rmsnorm", "peer_norm": "triton", "min_speedup": 3.0,
     "text": "ours through host memory, fused all-reduce + add + RMSNorm of [3, 7168] bf16: >= 3x faster than "
             "NCCL with P2P disabled followed by the Triton add+RMSNorm kernel"},
)
TARGET_KEYS = ("target", "op", "rows", "hidden", "ours", "peer", "required_speedup", "ours_us", "peer_us",
               "speedup", "met", "why")


def _measured(results: Iterable[Mapping], label: str, op: str, rows: int, hidden: int) -> Mapping | None:
    rs = [r for r in results if r.get("label") == label and r.get("op") == op and r.get("rows") == rows
          and r.get("hidden") == hidden]
    return rs[0] if rs else None


def evaluate_targets(results: Sequence[Mapping], targets: Iterable[Mapping], *, norm_kernel: str | None = None,
                     invalid: str | None = None) -> list[dict]:
    """One verdict per target: met True/False from speedup = peer_us / ours_us >= min_speedup, or met None with
    ``why`` when it cannot be judged (a side not measured or failed, the peer's norm kernel is not the one the
    target names, or ``invalid``: the run itself does not qualify)."""
    out = []
    for t in targets:
        e = {"target": t["name"], "text": t.get("text", ""), "op": t["op"], "rows": t["rows"], "hidden": t["hidden"],
             "ours": t["ours"], "peer": t["peer"], "required_speedup": float(t["min_speedup"]),
             "ours_us": None, "peer_us": None, "speedup": None, "met": None, "why": None}
        if t.get("peer_norm"):
            e["peer_norm_kernel"] = norm_kernel
        where = f"[{t['rows']}, {t['hidden']}] ({t['op']})"
        ours = _measured(results, t["ours"], t["op"], t["rows"], t["hidden"])
        peer = _measured(results, t["peer"], t["op"], t["rows"], t["hidden"])
        for side, r in (("ours_us", ours), ("peer_us", peer)):
            if r is not None and r.get("median_us") is not None and not r.get("error"):
                e[side] = r["median_us"]
        if invalid:
            e["why"] = invalid
        elif ours is None or peer is None:
            e["why"] = f"{t['ours'] if ours is None else t['peer']} not measured at {where}"
        elif e["ours_us"] is None or e["peer_us"] is None:
            bad = ours if e["ours_us"] is None else peer
            e["why"] = f"{bad.get('label')} has no time at {where}: {bad.get('error') or 'not timed'}"
        elif t.get("peer_norm") and not str(norm_kernel or "").lower().startswith(t["peer_norm"]):
            e["why"] = (f"the add+RMSNorm kernel of {t['peer']} was {norm_kernel!r}; the target is defined "
                        f"with the {t['peer_norm']} kernel (--norm-kernel {t['peer_norm']})")
        else:
            e["speedup"] = e["peer_us"] / e["ours_us"]
            e["met"] = e["speedup"] >= e["required_speedup"]
        out.append(e)
    return out


def _validate_targets(doc: Mapping) -> None:
    if "targets" not in doc:
        return
    _require(isinstance(doc["targets"], list), "targets must be a list")
    results = doc.get("results", [])
    for t in doc["targets"]:
        _require(isinstance(t, Mapping), f"bad target entry {t!r}")
        for k in TARGET_KEYS:
            _require(k in t, f"target {t.get('target')!r} lacks {k}")
        _require(t["met"] in (True, False, None), f"target {t['target']}: met must be true, false or null")
        if t["met"] is None:
            _require(isinstance(t["why"], str) and t["why"], f"target {t['target']}: not judged needs a why")
            continue
        for side, label in (("ours_us", t["ours"]), ("peer_us", t["peer"])):
            _require(_is_num(t[side]) and t[side] > 0, f"target {t['target']}: bad {side}")
            r = _measured(results, label, t["op"], t["rows"], t["hidden"])
            _require(r is not None and r.get("median_us") == t[side] and not r.get("error"),
                     f"target {t['target']}: {side} is not the measured median of {label}")
        speedup = t["peer_us"] / t["ours_us"]
        _require(_is_num(t["speedup"]) and math.isclose(t["speedup"], speedup, rel_tol=1e-9),
                 f"target {t['target']}: speedup is not peer_us / ours_us")
        _require(t["met"] == (speedup >= t["required_speedup"]),
                 f"target {t['target']}: met does not follow from the times")


def validate_allreduce_doc(doc: Mapping) -> None:
    _require(isinstance(doc, Mapping), "document must be an object")
    for k in ("hardware", "date", "results", "skipped", "crossover_bytes"):
        _require(k in doc, f"{k} missing")
    validate_hardware(doc["hardware"])
    _require(isinstance(doc["results"], list), "results must be a list")
    for r in doc["results"]:
        for k in ALLREDUCE_RESULT_KEYS:
            _require(k in r, f"result {r.get('impl')!r} lacks {k}")
        _require(r["op"] in OPS, f"bad op {r['op']!r}")
        _require(isinstance(r["bytes"], int) and r["bytes"] > 0, "bytes must be a positive int")
        _require(isinstance(r["world_size"], int) and r["world_size"] >= 2, "world_size must be >= 2")
        if r.get("error"):
            _require(r["median_us"] is None, "an errored result must not carry a time")
        else:
            _require(_is_num(r["median_us"]) and r["median_us"] > 0, f"bad median_us in {r!r}")
        if r["rows"] is not None:
            _require(r["bytes"] == r["rows"] * r["hidden"] * 2, "bytes != rows*hidden*2 (bf16)")
    _validate_skipped(doc)
    cb = doc["crossover_bytes"]
    _require(cb is None or (isinstance(cb, int) and cb > 0), "crossover_bytes must be null or a positive int")
    _validate_targets(doc)
    _validate_nccl_setup(doc)


def _validate_nccl_setup(doc: Mapping) -> None:
    """A --no-p2p document must show the NCCL it measured: NCCL_P2P_DISABLE=1 in the environment NCCL started
    with, no result under the plain `nccl` name; a default one no result under `nccl_no_p2p`."""
    if "no_p2p" not in doc:
        return
    setup = doc.get("nccl_setup")
    _require(isinstance(setup, Mapping), "nccl_setup missing")
    names = {r.get("impl", r.get("backend")) for r in doc.get("results", [])}
    if doc["no_p2p"]:
        _require(setup.get("env_at_init", {}).get("NCCL_P2P_DISABLE") == "1",
                 "a no_p2p document needs nccl_setup.env_at_init.NCCL_P2P_DISABLE == '1'")
        _require("nccl" not in names, "a no_p2p document must not hold results named nccl")
    else:
        _require("nccl_no_p2p" not in names, "nccl_no_p2p results need a no_p2p document")


def validate_verify_doc(doc: Mapping) -> None:
    _require(isinstance(doc, Mapping), "document must be an object")
    for k in ("hardware", "date", "config", "world_size", "pattern", "results", "skipped"):
        _require(k in doc, f"{k} missing")
    validate_hardware(doc["hardware"])
    pat = doc["pattern"]
    for k in ("n_allreduce", "n_fused", "n_plain"):
        _require(isinstance(pat.get(k), int), f"pattern.{k} missing")
    _require(pat["n_fused"] + pat["n_plain"] == pat["n_allreduce"], "pattern counts inconsistent")
    _require(isinstance(doc["results"], list), "results must be a list")
    for r in doc["results"]:
        for k in VERIFY_RESULT_KEYS:
            _require(k in r, f"verify result lacks {k}: {r!r}")
        _require(r["compute"] in ("none", "gemm"), f"bad compute {r['compute']!r}")
        _require(isinstance(r["tokens"], int) and r["tokens"] > 0, "tokens must be a positive int")
        _require(_is_num(r["step_us"]) and r["step_us"] > 0, f"bad step_us in {r!r}")
        _require(r["comm_us"] is None or _is_num(r["comm_us"]), f"bad comm_us in {r!r}")
    _validate_skipped(doc)
    _validate_nccl_setup(doc)


def e2e_estimate(
    nccl_comm_us: float,
    ours_comm_us: float,
    compute_ms: float,
    *,
    tok_s_eagle_nccl: float = 60.0,
    tok_s_nospec: float = 82.0,
    accept_len: float | None = None,
) -> dict:
    """Turn measured per-forward communication times into an end-to-end ESTIMATE (not a measurement).

    Model: verify step = compute_ms + communication (measured). With an acceptance length A (tokens per step):
    tok/s = A / step. Without A, A is chosen so that the NCCL step reproduces ``tok_s_eagle_nccl`` (the
    anchor reported for EAGLE-3 on NCCL), i.e. ours = anchor * step_nccl / step_ours (acceptance unchanged).
    """
    step_n = compute_ms + nccl_comm_us / 1000.0
    step_o = compute_ms + ours_comm_us / 1000.0
    a = accept_len if accept_len else tok_s_eagle_nccl * step_n / 1000.0
    tn = a / step_n * 1000.0
    to = a / step_o * 1000.0
    return {
        "compute_ms": compute_ms,
        "accept_len": a,
        "accept_len_source": "given" if accept_len else f"anchored: NCCL step = {tok_s_eagle_nccl:g} tok/s",
        "step_ms_nccl": step_n,
        "step_ms_ours": step_o,
        "step_speedup": step_n / step_o,
        "tok_s_nccl": tn,
        "tok_s_ours": to,
        "tok_s_nospec": tok_s_nospec,
        "beats_nospec": to > tok_s_nospec,
    }


def find(results: Iterable[Mapping], **match: Any) -> list[Mapping]:
    return [r for r in results if all(r.get(k) == v for k, v in match.items())]
