"""Result-document builders and validators shared by the benchmarks and their CPU tests (no torch import)."""

from __future__ import annotations

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


def pick_median(results: Sequence[Mapping], **match: Any) -> float | None:
    rs = [r for r in find(results, **match) if r.get("median_us") is not None]
    return rs[0]["median_us"] if rs else None
